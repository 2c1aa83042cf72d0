"""The ONNX graph of a whole BERT-family encoder with its pooling: token ids in, one
embedding per text out.

Inputs ``input_ids`` and ``attention_mask`` (``[batch, tokens]``, int64; padding has mask 0);
output ``embeddings`` (``[batch, hidden]``, float32). The layers are BERT's (post-norm,
bidirectional attention with biases, a learned position table, exact GELU) or nomic-bert's
(post-norm, bidirectional attention without biases, rotary positions, a SwiGLU MLP); the
pooling is the mean over the real tokens or the first token's state (``cls``), optionally
scaled to unit length: what a sentence-transformers folder's ``1_Pooling`` and ``Normalize`` modules say.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from shards.errors import ModelFormatError
from shards.store.encoder_manifest import POOLINGS, ROTARY_ARCHITECTURES, EncoderManifest

OPSET = 17  # LayerNormalization


@dataclass(frozen=True)
class EncoderShape:
    """What the graph needs to know of the model besides its weights."""

    n_layers: int
    hidden_size: int
    n_heads: int
    layer_norm_eps: float
    pooling: str
    normalize: bool
    architecture: str = "bert"
    rope_theta: float | None = None  # the rotary architectures'

    def __post_init__(self) -> None:
        if (self.architecture in ROTARY_ARCHITECTURES) != (self.rope_theta is not None):
            raise ModelFormatError(f"{self.architecture}: rope_theta is needed by rotary positions, and only there")
        if self.pooling not in POOLINGS:
            raise ModelFormatError(f"unknown pooling {self.pooling!r} (ncm pools by {', '.join(POOLINGS)})")
        if self.hidden_size % self.n_heads:
            raise ModelFormatError("hidden_size must be a multiple of the number of heads")

    @classmethod
    def of(cls, manifest: EncoderManifest) -> EncoderShape:
        return cls(manifest.n_layers, manifest.hidden_size, manifest.n_heads, manifest.layer_norm_eps,
                   manifest.pooling, manifest.normalize, manifest.architecture, manifest.rope_theta)


class _Builder:
    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.weights = weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def weight(self, key: str, *, transpose: bool = False) -> str:
        if key not in self.initializers:
            if key not in self.weights:
                raise ModelFormatError(f"the encoder has no tensor {key!r}")
            array = np.asarray(self.weights[key], dtype=np.float32)
            self.initializers[key] = numpy_helper.from_array(np.ascontiguousarray(array.T if transpose else array), key)
        return key

    def const(self, value: np.ndarray, hint: str) -> str:
        name = self.name(hint)
        self.initializers[name] = numpy_helper.from_array(value, name)
        return name

    def op(self, kind: str, inputs: list[str], hint: str, **attrs: object) -> str:
        out = self.name(hint)
        self.nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def linear(self, x: str, prefix: str, *, bias: bool = True) -> str:
        product = self.op("MatMul", [x, self.weight(f"{prefix}.weight", transpose=True)], "mm")
        return self.op("Add", [product, self.weight(f"{prefix}.bias")], "linear") if bias else product

    def norm(self, x: str, prefix: str, eps: float) -> str:
        return self.op("LayerNormalization", [x, self.weight(f"{prefix}.weight"), self.weight(f"{prefix}.bias")],
                       "norm", axis=-1, epsilon=eps)


class _Attention:
    """Bidirectional attention over all heads: queries, keys, values ``[batch, heads, tokens,
    head_dim]`` in, the merged context ``[batch, tokens, hidden]`` out."""

    def __init__(self, b: _Builder, shape: EncoderShape) -> None:
        self.head_dim = shape.hidden_size // shape.n_heads
        self.split = b.const(np.array([0, 0, shape.n_heads, self.head_dim], np.int64), "heads_shape")
        self.merge = b.const(np.array([0, 0, shape.hidden_size], np.int64), "hidden_shape")
        self.scale = b.const(np.array(1.0 / math.sqrt(self.head_dim), np.float32), "scale")

    def heads(self, b: _Builder, projected: str) -> str:
        return b.op("Transpose", [b.op("Reshape", [projected, self.split], "split")], "heads", perm=[0, 2, 1, 3])

    def context(self, b: _Builder, q: str, k: str, v: str, bias: str) -> str:
        scores = b.op("Add", [b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k], "kt", perm=[0, 1, 3, 2])],
                                                "qk"), self.scale], "scaled"), bias], "scores")
        context = b.op("MatMul", [b.op("Softmax", [scores], "probs", axis=-1), v], "context")
        return b.op("Reshape", [b.op("Transpose", [context], "merge", perm=[0, 2, 1, 3]), self.merge], "ctx")


# A layer: (builder, shape, attention, its input, the padding's score bias, its index) -> its output.
Layer = Callable[[_Builder, EncoderShape, _Attention, str, str, int], str]


def _bert_layer(b: _Builder, shape: EncoderShape, attention: _Attention, x: str, bias: str, i: int) -> str:
    """BERT's layer: attention with biases, exact GELU, each followed by its residual and norm."""
    p = f"encoder.layer.{i}"
    q, k, v = (attention.heads(b, b.linear(x, f"{p}.attention.self.{n}")) for n in ("query", "key", "value"))
    x = b.norm(b.op("Add", [x, b.linear(attention.context(b, q, k, v, bias), f"{p}.attention.output.dense")], "res1"),
               f"{p}.attention.output.LayerNorm", shape.layer_norm_eps)
    up = b.linear(x, f"{p}.intermediate.dense")
    half, root2 = b.const(np.array(0.5, np.float32), "half"), b.const(np.array(math.sqrt(2.0), np.float32), "root2")
    gelu = b.op("Mul", [b.op("Mul", [up, half], "half_x"),
                        b.op("Add", [b.const(np.array(1.0, np.float32), "one_g"),
                                     b.op("Erf", [b.op("Div", [up, root2], "x_r2")], "erf")], "one_erf")], "gelu")
    return b.norm(b.op("Add", [x, b.linear(gelu, f"{p}.output.dense")], "res2"), f"{p}.output.LayerNorm",
                  shape.layer_norm_eps)


def _nomic_layer(b: _Builder, shape: EncoderShape, positions: str) -> Layer:
    """nomic-bert's layer (its rotation tables built once): attention without biases on
    rotated queries and keys, then ``down(silu(gate(x)) * up(x))``, each followed by its
    residual and norm."""
    head_dim = shape.hidden_size // shape.n_heads
    inv_freq = 1.0 / (float(shape.rope_theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = b.op("Mul", [b.op("Unsqueeze", [b.op("Cast", [positions], "pos_f", to=TensorProto.FLOAT),
                                             b.const(np.array([1], np.int64), "ax1r")], "pos_col"),
                          b.const(inv_freq.astype(np.float32)[None, :], "inv_freq")], "angles")
    angles = b.op("Concat", [angles, angles], "angles2", axis=-1)  # [tokens, head_dim]
    cos, sin = b.op("Cos", [angles], "cos"), b.op("Sin", [angles], "sin")
    halves = b.const(np.array([head_dim // 2, head_dim // 2], np.int64), "halves")

    def rotate(t: str) -> str:  # t * cos + rotate_half(t) * sin
        first, second = b.name("first"), b.name("second")
        b.nodes.append(helper.make_node("Split", [t, halves], [first, second], axis=-1))
        turned = b.op("Concat", [b.op("Neg", [second], "neg_half"), first], "turned", axis=-1)
        return b.op("Add", [b.op("Mul", [t, cos], "t_cos"), b.op("Mul", [turned, sin], "t_sin")], "rotated")

    def layer(b: _Builder, shape: EncoderShape, attention: _Attention, x: str, bias: str, i: int) -> str:
        p = f"layers.{i}"
        q, k, v = (attention.heads(b, b.linear(x, f"{p}.self_attn.{n}_proj", bias=False)) for n in "qkv")
        context = attention.context(b, rotate(q), rotate(k), v, bias)
        x = b.norm(b.op("Add", [x, b.linear(context, f"{p}.self_attn.o_proj", bias=False)], "res1"),
                   f"{p}.post_attention_layernorm", shape.layer_norm_eps)
        gate = b.linear(x, f"{p}.mlp.gate_proj", bias=False)
        swiglu = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate], "sig")], "silu"),
                              b.linear(x, f"{p}.mlp.up_proj", bias=False)], "swiglu")
        return b.norm(b.op("Add", [x, b.linear(swiglu, f"{p}.mlp.down_proj", bias=False)], "res2"),
                      f"{p}.post_mlp_layernorm", shape.layer_norm_eps)

    return layer


def encoder_graph(weights: Mapping[str, np.ndarray], shape: EncoderShape) -> onnx.ModelProto:
    """The whole encoder and its pooling; ``weights`` by their Hugging Face names (BERT's
    ``embeddings.word_embeddings.weight``, ``encoder.layer.N.attention.self.query.weight``, ...;
    nomic-bert's ``layers.N.self_attn.q_proj.weight``, ...)."""
    b = _Builder(weights)
    ids, mask = "input_ids", "attention_mask"
    tokens = b.op("Squeeze", [b.op("Slice", [b.op("Shape", [ids], "shape"), b.const(np.array([1], np.int64), "one"),
                                             b.const(np.array([2], np.int64), "two")], "len"),
                              b.const(np.array([0], np.int64), "axis0")], "tokens")
    positions = b.op("Range", [b.const(np.array(0, np.int64), "zero"), tokens, b.const(np.array(1, np.int64), "step")],
                     "positions")
    # embeddings: word (+ position from the table) + token type 0, then a norm
    x = b.op("Gather", [b.weight("embeddings.word_embeddings.weight"), ids], "words")
    if shape.rope_theta is None:
        x = b.op("Add", [x, b.op("Gather", [b.weight("embeddings.position_embeddings.weight"), positions], "pos")],
                 "embed")
    token_type = np.asarray(weights["embeddings.token_type_embeddings.weight"], np.float32)[0]
    x = b.op("Add", [x, b.const(token_type, "type0")], "embed")
    x = b.norm(x, "embeddings.LayerNorm", shape.layer_norm_eps)
    # padding: -10000 added to the scores of padded keys, [batch, 1, 1, tokens]
    mask_f = b.op("Cast", [mask], "mask_f", to=TensorProto.FLOAT)
    bias = b.op("Mul", [b.op("Sub", [b.const(np.array(1.0, np.float32), "one_f"), mask_f], "pad"),
                        b.const(np.array(-10000.0, np.float32), "neg")], "pad_bias")
    bias = b.op("Unsqueeze", [bias, b.const(np.array([1, 2], np.int64), "axes12")], "pad_bias4")
    layer = _bert_layer if shape.rope_theta is None else _nomic_layer(b, shape, positions)
    attention = _Attention(b, shape)
    for i in range(shape.n_layers):
        x = layer(b, shape, attention, x, bias, i)
    if shape.pooling == "cls":
        pooled = b.op("Squeeze", [b.op("Slice", [x, b.const(np.array([0], np.int64), "s0"),
                                                 b.const(np.array([1], np.int64), "s1"),
                                                 b.const(np.array([1], np.int64), "ax1")], "first"),
                                  b.const(np.array([1], np.int64), "ax1s")], "cls")
    else:
        weights3 = b.op("Unsqueeze", [mask_f, b.const(np.array([2], np.int64), "ax2")], "mask3")
        total = b.op("ReduceSum", [b.op("Mul", [x, weights3], "masked"), b.const(np.array([1], np.int64), "r1")],
                     "sum", keepdims=0)
        count = b.op("Max", [b.op("ReduceSum", [mask_f, b.const(np.array([1], np.int64), "r1c")], "count",
                                  keepdims=1), b.const(np.array(1e-9, np.float32), "tiny")], "count_safe")
        pooled = b.op("Div", [total, count], "mean")
    if shape.normalize:
        length = b.op("Max", [b.op("ReduceL2", [pooled], "l2", axes=[1], keepdims=1),  # axes: an attribute before opset 18
                              b.const(np.array(1e-12, np.float32), "eps_n")], "l2_safe")
        pooled = b.op("Div", [pooled, length], "unit")
    b.nodes.append(helper.make_node("Identity", [pooled], ["embeddings"]))
    graph = helper.make_graph(
        b.nodes, "ncm-encoder",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, ["batch", "tokens"]),
         helper.make_tensor_value_info(mask, TensorProto.INT64, ["batch", "tokens"])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", shape.hidden_size])],
        list(b.initializers.values()))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="ncm")


__all__ = ["EncoderShape", "encoder_graph"]
