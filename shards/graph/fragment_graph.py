"""The graphs of :mod:`shards.graph.fragment`, emitted with ``onnx.helper``.

:mod:`shards.graph.fragment` (the flavours, the cache, the keys) imports this module only when a
fragment is not in the cache yet: loading ``onnx`` costs most of a second, which a start
that finds its fragments built does not pay.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from shards.graph.spec import FINAL_HIDDEN, FUSED_FLAVOURS, IR_VERSION, ONNX_FILE, FragmentSpec
from shards.importers.stored_form import load_stored
from shards.store.manifest import BLOCK_FORMATS, Manifest, layer_key

log = logging.getLogger(__name__)
INT8_ACTIVATIONS = 4  # MatMulNBits' accuracy_level that quantises x to int8 (per block of 32)
RMS_SCALE_FLOOR = 1e-3  # the static flavour's RMS norms divide a row by its largest |x|, at least this
MS = "com.microsoft"
_NEG = -1e30
_INLINE_BYTES = 1024


def write_fragment(model_dir: Path, m: Manifest, spec: FragmentSpec, out_dir: Path, pool: Path, *,
                   q4_level: int, q8_level: int, int8_min_weights: int = 0, int8_twice: bool = True) -> int:
    """Write the fragment ``spec`` of model ``m`` into ``out_dir`` (weights linked from
    ``pool``); returns its weight bytes. ``q4_level``, ``q8_level``: MatMulNBits' accuracy_level
    on CPU for 4-bit and 8-bit weights; a 4-bit product with fewer than ``int8_min_weights``
    weights takes float activations whatever ``q4_level`` says; products on int8 activations take
    x twice (about 16 bits) unless ``int8_twice`` is False (see :mod:`shards.graph.fragment`)."""
    g = _Graph(out_dir, pool)
    builder = _Builder(model_dir, m, spec, g, q4_level, q8_level, int8_min_weights, int8_twice)
    onnx.save_model(builder.build(), out_dir / ONNX_FILE)
    return g.weight_bytes


def rope_tables(m: Manifest, n_positions: int, sliding: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables float32 [n_positions, rotary_width/2] (with llama3 frequency factors, times
    the rotary scale); those of the sliding-window layers when they have a rotary base of their
    own (no factors, no scale)."""
    hd = m.rotary_width
    own_base = sliding and m.sliding_rope_theta is not None
    theta = m.sliding_rope_theta if own_base else m.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if m.rope_freq_factors is not None and not own_base:
        inv = inv / np.asarray(m.rope_freq_factors, dtype=np.float64)
    ang = np.arange(n_positions, dtype=np.float64)[:, None] * inv[None, :]
    scale = 1.0 if own_base else m.rotary_scale
    return (scale * np.cos(ang)).astype(np.float32), (scale * np.sin(ang)).astype(np.float32)


class _Graph:
    """Accumulates nodes and initializers; big initializers go to content-addressed files."""

    def __init__(self, out_dir: Path, pool: Path) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.out_dir, self.pool = out_dir, pool
        self._n = 0
        self._consts: set[str] = set()
        self.weight_bytes = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, name: str, arr: np.ndarray) -> str:
        """Register initializer ``name`` (a repeated name is reused: same name, same value)."""
        if name in self._consts:
            return name
        self._consts.add(name)
        arr = np.asarray(arr)
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
            arr = arr.copy(order="C")
        if arr.nbytes <= _INLINE_BYTES:
            self.inits.append(onnx.numpy_helper.from_array(arr, name))
            return name
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
        t.dims.extend(arr.shape)
        location = self._blob(arr)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(arr.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)
        self.weight_bytes += arr.nbytes
        return name

    def _blob(self, arr: np.ndarray) -> str:
        """Put ``arr``'s bytes in the fragment as ``<sha256>.bin``, linked from the pool if there."""
        digest = hashlib.sha256(arr.data.cast("B")).hexdigest()
        name = digest + ".bin"
        target, pooled = self.out_dir / name, self.pool / digest
        if target.exists():  # the same bytes twice in one fragment
            return name
        try:
            if pooled.stat().st_size == arr.nbytes:
                os.link(pooled, target)
                return name
            pooled.unlink()  # cut short (a power loss while it was written): written again below
        except OSError:  # not pooled yet, or no hard links on this file system: write it
            pass
        with open(target, "wb") as f:
            f.write(arr.data.cast("B"))
        try:
            os.link(target, pooled)
        except FileExistsError:  # another build pooled it meanwhile
            pass
        except OSError as error:
            log.debug("fragment blob %s not pooled: %s", digest[:12], error)
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", out: list[str] | None = None,
           **attrs: object) -> list[str]:
        outs = out or [self.name(op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name("n_" + op_type),
                                           domain=domain or None, **attrs))
        return outs

    def op1(self, op_type: str, inputs: list[str], domain: str = "", **attrs: object) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]


class _Builder:
    """Emits one fragment graph for a manifest, a layer range and a flavour.

    Over 250 lines: one method per part of a layer (norms, attention, rotary, MLP, experts,
    output) in every flavour, each emitting into the one graph being built."""

    def __init__(self, model_dir: Path, m: Manifest, spec: FragmentSpec, g: _Graph, q4_level: int,
                 q8_level: int, int8_min_weights: int, int8_twice: bool) -> None:
        self.dir, self.m, self.s, self.g = model_dir, m, spec, g
        self.levels = {4: q4_level, 8: q8_level}
        self.int8_min_weights = int8_min_weights
        self.int8_twice = int8_twice
        self.q4 = m.weight_format in BLOCK_FORMATS
        self.fused = spec.flavour in FUSED_FLAVOURS
        half = spec.flavour == "gpu"
        self.dtype = np.float16 if half else np.float32  # what the graph computes in
        self.elem = TensorProto.FLOAT16 if half else TensorProto.FLOAT

    # --- weights ------------------------------------------------------------------------
    def _load(self, key: str) -> dict[str, np.ndarray]:
        return load_stored(self.dir, self.m, key)

    def linear(self, x: str, t: dict[str, np.ndarray], names: list[str], label: str) -> str:
        """x @ concat(W_names)^T, float32 MatMul or MatMulNBits."""
        g = self.g
        if self.q4:
            return self._linear_nbits(x, t, names, label)
        w = np.concatenate([t[n].astype(self.dtype) for n in names], axis=0)
        return g.op1("MatMul", [x, g.const(label + ".weight", np.ascontiguousarray(w.T))])

    def _linear_nbits(self, x: str, t: dict[str, np.ndarray], names: list[str], label: str) -> str:
        """MatMulNBits; 4-bit weights also add ``blocksum(x) @ offsets^T`` (see shards.importers.quant).

        On int8 activations (accuracy_level 4 on CPU, which quantises each block of 32 of x to
        int8 by its largest magnitude), the product is taken on x and on what that rounding left
        of x (``x - q(x)``, itself rounded to int8 by the kernel), stacked as the rows of one call
        and summed after it, so x counts with about 16 bits: a decode step reads the weights once,
        a prompt costs twice the int8 arithmetic. Without ``int8_twice``, x alone (8 bits)."""
        g = self.g
        if len({t[f"{n}.qweight"].shape[-1] for n in names}) > 1:  # a mixed store: 4- and 8-bit apart
            return g.op1("Concat", [self._linear_nbits(x, t, [n], f"{label}.{n}") for n in names], axis=-1)
        qw = np.concatenate([t[f"{n}.qweight"] for n in names], axis=0)
        sc = np.concatenate([t[f"{n}.scales"] for n in names], axis=0)
        n_out, kb, blob = qw.shape
        bits = blob * 8 // 32
        ins = [g.const(label + ".qweight", qw), g.const(label + ".scales", sc.reshape(-1).astype(self.dtype))]
        if bits == 8:
            zp = np.concatenate([t[f"{n}.zeros"] for n in names], axis=0)
            ins.append(g.const(label + ".zeros", zp.reshape(-1)))
        level = 0 if self.s.flavour == "gpu" else self.levels[bits]
        if bits == 4 and n_out * kb * 32 < self.int8_min_weights:
            level = 0
        blocks = g.const(f"blocks_shape_{kb}", np.array([0, 0, kb, 32], np.int64))
        rows = x
        twice = level == INT8_ACTIVATIONS and self.int8_twice
        if twice:  # x, then what its rounding leaves, as rows of one product
            xb = g.op1("Reshape", [x, blocks])
            residue = g.op1("Reshape", [g.op1("Sub", [xb, self._int8_rounded(xb)]), g.op1("Shape", [x])])
            rows = g.op1("Concat", [x, residue], axis=-2)
        y = g.op1("MatMulNBits", [rows, *ins], domain=MS, K=kb * 32, N=n_out, bits=bits, block_size=32,
                  accuracy_level=level)
        if twice:  # [.., 2T, N] -> the two halves summed
            halves = g.const(f"halves_shape_{n_out}", np.array([0, 2, -1, n_out], np.int64))
            y = g.op1("ReduceSum", [g.op1("Reshape", [y, halves]), g.const("axis_1", np.array([1], np.int64))],
                      keepdims=0)
        off = None
        if bits == 4 and any(f"{n}.offsets" in t for n in names):  # none stored: symmetric blocks (GGUF Q4_0)
            off = np.concatenate([t.get(f"{n}.offsets", np.zeros((len(t[f"{n}.scales"]), kb), np.float32))
                                  for n in names], axis=0)
        if off is not None and off.any():  # all zero: nothing to add
            bsum = g.op1("ReduceSum", [g.op1("Reshape", [x, blocks]), g.const("axis_last", np.array([-1], np.int64))],
                         keepdims=0)
            offsets = np.ascontiguousarray(off.T.astype(self.dtype))
            y = g.op1("Add", [y, g.op1("MatMul", [bsum, g.const(label + ".offsets", offsets)])])
        return y

    def _int8_rounded(self, xb: str) -> str:
        """``xb`` [.., blocks, 32] as an int8 kernel sees it: each block rounded to multiples of
        its largest magnitude / 127."""
        g = self.g
        step = g.op1("Div", [g.op1("ReduceMax", [g.op1("Abs", [xb])], axes=[-1], keepdims=1),
                             g.const("int8_peak", np.array(127.0, self.dtype))])
        safe = g.op1("Max", [step, g.const("tiny_step", np.array(np.finfo(self.dtype).tiny, self.dtype))])
        return g.op1("Mul", [g.op1("Round", [g.op1("Div", [xb, safe])]), step])

    def embed(self, ids: str) -> str:
        """The float32 rows of the embedding table for ``ids``, times the model's embedding scale."""
        return self.scaled(self._embedding_rows(ids), self.m.embedding_scale, "embedding_scale", np.float32)

    def softcapped(self, x: str, cap: float, label: str, dtype: type = np.float32) -> str:
        """cap * tanh(x / cap) (``x`` of ``dtype``), or ``x`` for no cap (0)."""
        if not cap:
            return x
        inside = self.g.op1("Tanh", [self.scaled(x, 1.0 / cap, f"{label}_inverse", dtype)])
        return self.scaled(inside, cap, label, dtype)

    def scaled(self, x: str, factor: float, label: str, dtype: type | None = None) -> str:
        """``x`` times ``factor`` (a constant of ``dtype``, default the compute precision), or ``x`` for 1."""
        if factor == 1.0:
            return x
        return self.g.op1("Mul", [x, self.g.const(label, np.array(factor, dtype or self.dtype))])

    def _embedding_rows(self, ids: str) -> str:
        """The float32 rows of the table for ``ids`` (a float table, or 8-bit blocks whose
        gathered rows are dequantised)."""
        g, t = self.g, self._load("embed")
        if "embed" in t:
            x = g.op1("Gather", [g.const("embed", t["embed"]), ids], axis=0)
            return x if t["embed"].dtype == np.float32 else g.op1("Cast", [x], to=TensorProto.FLOAT)
        codes = g.op1("Cast", [g.op1("Gather", [g.const("embed.qweight", t["embed.qweight"]), ids], axis=0)],
                      to=TensorProto.FLOAT)
        zeros = g.op1("Cast", [g.op1("Gather", [g.const("embed.zeros", t["embed.zeros"]), ids], axis=0)],
                      to=TensorProto.FLOAT)
        scales = g.op1("Gather", [g.const("embed.scales", t["embed.scales"]), ids], axis=0)
        ax = g.const("axis_last", np.array([-1], np.int64))
        rows = g.op1("Mul", [g.op1("Sub", [codes, g.op1("Unsqueeze", [zeros, ax])]), g.op1("Unsqueeze", [scales, ax])])
        shape = g.op1("Concat", [g.op1("Shape", [ids]), g.const("hidden_dim", np.array([self.m.hidden_size], np.int64))],
                      axis=0)
        return g.op1("Reshape", [rows, shape])

    # --- norms ----------------------------------------------------------------------------
    def rms(self, x: str, w: np.ndarray, label: str) -> str:
        """RMS norm from plain ops (the "cpu" flavour uses the fused add_rms everywhere).

        The static flavour runs on fp16 NPUs, where x * x overflows (65504) once |x| passes 256,
        and hidden states reach thousands: it normalises x' = x / s with s = max |x| of the row
        (at least RMS_SCALE_FLOOR, so a padded row of zeros stays finite), which gives the same
        value for any s > 0: x / sqrt(mean(x^2) + eps) = x' / sqrt(mean(x'^2) + eps / s^2)."""
        g, eps = self.g, float(self.m.rms_norm_eps)
        wn = g.const(label, w.astype(np.float32))
        eps_term = g.const("rms_eps", np.array(eps, np.float32))
        if self.s.flavour == "static":
            peak = g.op1("ReduceMax", [g.op1("Abs", [x])], axes=[-1], keepdims=1)
            inv_s = g.op1("Reciprocal", [g.op1("Max", [peak, g.const("rms_scale_floor", np.array(RMS_SCALE_FLOOR, np.float32))])])
            x = g.op1("Mul", [x, inv_s])
            eps_term = g.op1("Mul", [g.op1("Mul", [eps_term, inv_s]), inv_s])  # in this order: no fp16 overflow
        sq = g.op1("Mul", [x, x])
        ms = g.op1("ReduceMean", [sq], axes=[-1], keepdims=1)
        inv = g.op1("Reciprocal", [g.op1("Sqrt", [g.op1("Add", [ms, eps_term])])])
        return g.op1("Mul", [g.op1("Mul", [x, inv]), wn])

    def head_norm(self, x: str, w: np.ndarray, n_heads: int, label: str) -> str:
        """RMS norm of each of the ``n_heads`` equal parts of ``x`` [B, T, width] (in float32,
        whatever the compute precision: un-normed queries and keys may pass float16's range when
        squared)."""
        g = self.g
        hd = w.shape[0] if n_heads == 1 else self.m.head_dim
        heads = g.op1("Reshape", [self.residual_precision(x),
                                  g.const(f"per_head_shape_{n_heads}x{hd}", np.array([0, 0, n_heads, hd], np.int64))])
        flat = g.const(f"flat_heads_shape_{n_heads}x{hd}", np.array([0, 0, n_heads * hd], np.int64))
        return self.compute_precision(g.op1("Reshape", [self.rms(heads, w, label), flat]))

    def add_rms(self, x: str, residual: str, w: np.ndarray, label: str) -> tuple[str, str]:
        """(rms(x + residual) * w, x + residual)."""
        g = self.g
        if self.fused:
            out = g.op("SkipSimplifiedLayerNormalization", [self.residual_precision(x), residual,
                                                            g.const(label, w.astype(np.float32))],
                       out=[g.name("skipnorm"), "", "", g.name("resid")], domain=MS, epsilon=float(self.m.rms_norm_eps))
            return self.compute_precision(out[0]), out[3]
        s = g.op1("Add", [x, residual])
        return self.rms(s, w, label), s

    def residual_precision(self, x: str) -> str:
        """``x`` (a sublayer's output) in the residual stream's float32."""
        return x if self.elem == TensorProto.FLOAT else self.g.op1("Cast", [x], to=TensorProto.FLOAT)

    def compute_precision(self, x: str) -> str:
        """``x`` (float32) in the precision the matrix products run in."""
        return x if self.elem == TensorProto.FLOAT else self.g.op1("Cast", [x], to=self.elem)

    # --- prologue ---------------------------------------------------------------------------
    def prologue_cpu(self, x: str) -> dict[str, str]:
        """Per row b: positions past_length[b] .. past_length[b] + T - 1 (rows of a batch may hold
        different lengths; GroupQueryAttention reads each row's from ``seqlens``)."""
        g = self.g
        t_len = g.op1("Shape", [x], start=1, end=2)
        total = g.op1("Add", ["past_length", t_len])
        one = g.const("one_i64", np.array([1], np.int64))
        seqlens = g.op1("Cast", [g.op1("Sub", [total, one])], to=TensorProto.INT32)
        longest = g.op1("ReduceMax", [total], keepdims=0)
        total_s = g.op1("Cast", [longest], to=TensorProto.INT32)
        steps = g.op1("Range", [g.const("zero_s_i64", np.array(0, np.int64)), g.op1("Squeeze", [t_len]),
                                g.const("one_s_i64", np.array(1, np.int64))])
        pos = g.op1("Add", [g.op1("Unsqueeze", ["past_length", g.const("one_ax", np.array([1], np.int64))]),
                            g.op1("Unsqueeze", [steps, g.const("zero_ax", np.array([0], np.int64))])])
        out = {"seqlens": seqlens, "total": total_s, "pos": pos}
        for kind in self._rope_kinds():
            cos, sin = rope_tables(self.m, self.s.max_context, sliding=kind == "sliding")
            out[f"cos{kind}"] = g.const(f"rope{kind}.cos", cos.astype(self.dtype))
            out[f"sin{kind}"] = g.const(f"rope{kind}.sin", sin.astype(self.dtype))
        return out

    def _rope_kinds(self) -> tuple[str, ...]:
        """Suffixes of the rotary tables: "" (every layer's), and "sliding" when the sliding
        layers rotate with a base of their own."""
        return ("", "sliding") if self.m.sliding_layers and self.m.sliding_rope_theta is not None else ("",)

    def _layer_view(self, pro: dict[str, str], li: int) -> dict[str, str]:
        """The prologue's names as layer ``li`` uses them: its rotary tables and its mask."""
        if li not in self.m.sliding_layers:
            return pro
        view = dict(pro)
        for name in ("cos", "sin", "mask_grouped"):
            view[name] = pro.get(name + "sliding", pro.get(name, ""))
        return view

    def prologue_static(self) -> dict[str, str]:
        g, c, mc = self.g, self.s.prefill_chunk, self.s.max_context
        pos = g.op1("Add", ["past_length", g.const("chunk_arange", np.arange(c, dtype=np.int64))])
        out = self._gathered_rope(pos, mc + c)
        visible = g.op1("Less", [g.const("ctx_arange", np.arange(mc, dtype=np.int64)), "past_length"])
        past_mask = g.op1("Where", [visible, g.const("zero_f", np.array(0.0, np.float32)),
                                    g.const("neg_f", np.array(_NEG, np.float32))])
        past_mask = g.op1("Expand", [g.op1("Unsqueeze", [past_mask, g.const("zero_ax", np.array([0], np.int64))]),
                                     g.const("mask_shape", np.array([c, mc], np.int64))])
        causal = np.where(np.tril(np.ones((c, c), bool)), 0.0, _NEG).astype(np.float32)
        mask = g.op1("Concat", [past_mask, g.const("causal", causal)], axis=1)
        out["mask"] = mask
        if self.m.sliding_layers:  # keys: the cache's slots 0..mc-1 hold positions 0..mc-1, then the chunk's
            kpos = g.op1("Concat", [g.const("ctx_arange", np.arange(mc, dtype=np.int64)), pos], axis=0)
            out["masksliding"] = self._window(mask, kpos, pos)
        return out

    def _gathered_rope(self, pos: str, n_positions: int) -> dict[str, str]:
        """Rotary cos and sin rows (full head width) of positions ``pos``, per table kind."""
        g, out = self.g, {}
        for kind in self._rope_kinds():
            cos, sin = rope_tables(self.m, n_positions, sliding=kind == "sliding")
            cos_full = g.const(f"rope{kind}.cos", np.concatenate([cos, cos], axis=1))
            sin_full = g.const(f"rope{kind}.sin", np.concatenate([sin, sin], axis=1))
            out[f"cos{kind}"] = g.op1("Gather", [cos_full, pos], axis=0)
            out[f"sin{kind}"] = g.op1("Gather", [sin_full, pos], axis=0)
        return out

    def _window(self, mask: str, kpos: str, qpos: str) -> str:
        """``mask`` [queries, keys] with the keys more than sliding_window - 1 positions before
        their query hidden as well."""
        g = self.g
        lowest = g.op1("Sub", [g.op1("Unsqueeze", [qpos, g.const("one_ax", np.array([1], np.int64))]),
                               g.const("window_reach", np.array(self.m.sliding_window, np.int64))])
        inside = g.op1("Greater", [g.op1("Unsqueeze", [kpos, g.const("zero_ax", np.array([0], np.int64))]), lowest])
        return g.op1("Where", [inside, mask, g.const("neg_f", np.array(_NEG, np.float32))])

    def prologue_portable(self, x: str, past0: str) -> dict[str, str]:
        """Dynamic T and P: positions P..P+T-1, mask [T, P+T] (key j visible to row i iff j <= P+i)."""
        g = self.g
        t_len = g.op1("Squeeze", [g.op1("Shape", [x], start=1, end=2)])
        p_len = g.op1("Squeeze", [g.op1("Shape", [past0], start=2, end=3)])
        total = g.op1("Add", [p_len, t_len])
        one = g.const("one_s_i64", np.array(1, np.int64))
        pos = g.op1("Range", [p_len, total, one])
        kpos = g.op1("Range", [g.const("zero_s_i64", np.array(0, np.int64)), total, one])
        ax = g.const("one_ax", np.array([1], np.int64))
        visible = g.op1("LessOrEqual", [g.op1("Unsqueeze", [kpos, g.const("zero_ax", np.array([0], np.int64))]),
                                        g.op1("Unsqueeze", [pos, ax])])
        mask = g.op1("Where", [visible, g.const("zero_f", np.array(0.0, np.float32)),
                               g.const("neg_f", np.array(_NEG, np.float32))])
        out = self._gathered_rope(pos, self.s.max_context)
        out["mask"] = mask
        if self.m.sliding_layers:
            out["masksliding"] = self._window(mask, kpos, pos)
        return out

    # --- attention ----------------------------------------------------------------------------
    def attention_cpu(self, xn: str, t: dict[str, np.ndarray], li: int, pro: dict[str, str]) -> tuple[str, str, str]:
        g, m = self.g, self.m
        qkv = self.linear(xn, t, ["q_proj", "k_proj", "v_proj"], f"l{li}.qkv")
        if m.attention_bias:
            qkv = self.add_bias(qkv, t, ["q_bias", "k_bias", "v_bias"], f"l{li}.qkv")
        qkv_in = [qkv, "", ""]
        if m.qk_norm:  # normed before GroupQueryAttention rotates them: q, k, v apart
            q_dim, kv_dim = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
            q, k, v = g.op("Split", [qkv, g.const("split_qkv", np.array([q_dim, kv_dim, kv_dim], np.int64))],
                           n_out=3, axis=-1)
            qkv_in = [self.head_norm(q, t["q_norm"], 1 if m.qk_norm_whole else m.n_heads, f"l{li}.q_norm"),
                      self.head_norm(k, t["k_norm"], 1 if m.qk_norm_whole else m.n_kv_heads, f"l{li}.k_norm"), v]
        outs = g.op("GroupQueryAttention",
                    [*qkv_in, f"past_key.{li}", f"past_value.{li}", pro["seqlens"], pro["total"],
                     pro["cos"], pro["sin"], pro["pos"]],
                    out=[g.name("attn"), f"present_key.{li}", f"present_value.{li}"], domain=MS,
                    num_heads=m.n_heads, kv_num_heads=m.n_kv_heads, do_rotary=int(li not in m.layers_without_rope),
                    rotary_interleaved=0, scale=self.attention_scale(),
                    local_window_size=m.sliding_window if li in m.sliding_layers else -1,
                    **({"softcap": m.attention_softcap} if m.attention_softcap else {}))
        return outs[0], outs[1], outs[2]

    def _proj_heads(self, xn: str, t: dict[str, np.ndarray], name: str, bias: str, n_heads: int, li: int) -> str:
        """[1, C, hidden] -> [1, n_heads, C, head_dim]."""
        g, m = self.g, self.m
        y = self.linear(xn, t, [name], f"l{li}.{name}")
        if m.attention_bias:
            y = g.op1("Add", [y, g.const(f"l{li}.{bias}", t[bias].astype(np.float32))])
        if m.qk_norm_whole and name in ("q_proj", "k_proj"):  # over the whole projection, before the heads
            norm = name[0] + "_norm"
            y = self.rms(y, t[norm], f"l{li}.{norm}")
        y = g.op1("Reshape", [y, g.const(f"heads_shape_{n_heads}", np.array([1, -1, n_heads, m.head_dim], np.int64))])
        return g.op1("Transpose", [y], perm=[0, 2, 1, 3])

    def _rotate(self, x: str, pro: dict[str, str]) -> str:
        """``x`` [.., head_dim] with its first rotary_width dims turned, the rest as they are."""
        g, width, hd = self.g, self.m.rotary_width, self.m.head_dim
        passed = None
        if width < hd:
            x, passed = g.op("Split", [x, g.const("split_rotary", np.array([width, hd - width], np.int64))],
                             n_out=2, axis=-1)
        half = width // 2
        x1, x2 = g.op("Split", [x, g.const("split_half", np.array([half, half], np.int64))], n_out=2, axis=-1)
        rot = g.op1("Concat", [g.op1("Neg", [x2]), x1], axis=-1)
        turned = g.op1("Add", [g.op1("Mul", [x, pro["cos"]]), g.op1("Mul", [rot, pro["sin"]])])
        return turned if passed is None else g.op1("Concat", [turned, passed], axis=-1)

    def attention_plain(self, xn: str, t: dict[str, np.ndarray], li: int, pro: dict[str, str]) -> tuple[str, str, str]:
        """Attention from plain ops; returns (output, key out, value out) per the flavour's KV contract."""
        g, m, static = self.g, self.m, self.s.flavour == "static"
        kvh, hd = m.n_kv_heads, m.head_dim
        q = self._proj_heads(xn, t, "q_proj", "q_bias", m.n_heads, li)
        k = self._proj_heads(xn, t, "k_proj", "k_bias", kvh, li)
        if m.qk_norm and not m.qk_norm_whole:  # [1, heads, C, head_dim]: normed over the last axis
            q, k = self.rms(q, t["q_norm"], f"l{li}.q_norm"), self.rms(k, t["k_norm"], f"l{li}.k_norm")
        if li not in m.layers_without_rope:
            q, k = self._rotate(q, pro), self._rotate(k, pro)
        v = self._proj_heads(xn, t, "v_proj", "v_bias", kvh, li)
        if static:  # the caller writes the chunk's keys/values into its fixed-size cache
            k_out = g.op("Identity", [k], out=[f"new_key.{li}"])[0]
            v_out = g.op("Identity", [v], out=[f"new_value.{li}"])[0]
            k_all = g.op1("Concat", [f"past_key.{li}", k_out], axis=2)
            v_all = g.op1("Concat", [f"past_value.{li}", v_out], axis=2)
        else:
            k_all = k_out = g.op("Concat", [f"past_key.{li}", k], out=[f"present_key.{li}"], axis=2)[0]
            v_all = v_out = g.op("Concat", [f"past_value.{li}", v], out=[f"present_value.{li}"], axis=2)[0]
        # group the query heads of each KV head: [1, kvh, grp * T, hd] (head h uses KV head h // grp)
        qg = g.op1("Reshape", [q, g.const("q_group_shape", np.array([1, kvh, -1, hd], np.int64))])
        sc = g.op1("MatMul", [qg, g.op1("Transpose", [k_all], perm=[0, 1, 3, 2])])
        sc = g.op1("Mul", [sc, g.const("attn_scale", np.array(self.attention_scale(), np.float32))])
        sc = self.softcapped(sc, m.attention_softcap, "attn_softcap")
        p = g.op1("Softmax", [g.op1("Add", [sc, pro["mask_grouped"]])], axis=-1)
        o = g.op1("MatMul", [p, v_all])
        o = g.op1("Reshape", [o, g.const("o_heads_shape", np.array([1, m.n_heads, -1, hd], np.int64))])
        o = g.op1("Transpose", [o], perm=[0, 2, 1, 3])
        o = g.op1("Reshape", [o, g.const("o_flat_shape", np.array([1, -1, m.n_heads * hd], np.int64))])
        return o, k_out, v_out

    def attention_scale(self) -> float:
        m = self.m
        return float(m.attention_scale if m.attention_scale is not None else 1.0 / np.sqrt(m.head_dim))

    def add_bias(self, y: str, t: dict[str, np.ndarray], names: list[str], label: str) -> str:
        """y + concat(t[names]) (in the graph's precision, whatever the weight format)."""
        b = np.concatenate([t[n].astype(self.dtype) for n in names])
        return self.g.op1("Add", [y, self.g.const(label + ".bias", b)])

    def mlp(self, xn: str, t: dict[str, np.ndarray], li: int, prefix: str = "") -> str:
        """The gated MLP; ``prefix`` names an expert's (``experts.E.``, ``expert_intermediate_size``
        wide) or the shared expert's (``shared_expert.``)."""
        if self.m.n_experts and not prefix:
            return self.experts(xn, t, li)
        g, m = self.g, self.m
        f = (m.shared_expert_intermediate_size if prefix == "shared_expert." else m.expert_intermediate_size) \
            if prefix else m.intermediate_size
        gu = self.linear(xn, t, [prefix + "gate_proj", prefix + "up_proj"], f"l{li}.{prefix}gate_up")
        if self.m.mlp_bias:
            gu = self.add_bias(gu, t, ["gate_bias", "up_bias"], f"l{li}.gate_up")
        gate, up = g.op("Split", [gu, g.const(f"split_ff_{f}", np.array([f, f], np.int64))], n_out=2, axis=-1)
        act = self.activation(gate)
        down = self.linear(g.op1("Mul", [act, up]), t, [prefix + "down_proj"], f"l{li}.{prefix}down")
        if self.m.mlp_bias:
            down = self.add_bias(down, t, ["down_bias"], f"l{li}.down")
        return down

    def experts(self, xn: str, t: dict[str, np.ndarray], li: int) -> str:
        """The mixture of experts: each row's router softmax picks its experts; each expert runs on
        the rows that picked it only (none: no work, and its weights are not read), its output
        weighted by the row's probability for it and added into the row's."""
        g, m = self.g, self.m
        ax = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731 - index constants
        rows = g.op1("Reshape", [xn, ax("rows_shape", [-1, m.hidden_size])])
        router = np.ascontiguousarray(t["router"].astype(self.dtype).T)
        probs = g.op1("Softmax", [g.op1("MatMul", [rows, g.const(f"l{li}.router", router)])], axis=-1)
        top_p, top_i = g.op("TopK", [probs, ax("experts_per_token", [m.experts_per_token])], n_out=2, axis=-1)
        if m.renormalize_experts:
            top_p = g.op1("Div", [top_p, g.op1("ReduceSum", [top_p, ax("axis_last", [-1])], keepdims=1)])
        out = g.op1("Mul", [self.residual_precision(rows), g.const("zero_f32", np.array(0.0, np.float32))])
        for e in range(m.n_experts):
            picked = g.op1("Equal", [top_i, ax(f"expert_{e}", e)])
            weight = g.op1("ReduceSum", [g.op1("Where", [picked, top_p, g.const("zero_c", np.array(0.0, self.dtype))]),
                                         ax("axis_last", [-1])], keepdims=0)
            taken = g.op1("Cast", [g.op1("ReduceMax", [g.op1("Cast", [picked], to=TensorProto.INT32)],
                                         axes=[-1], keepdims=0)], to=TensorProto.BOOL)
            index = g.op1("Transpose", [g.op1("NonZero", [taken])], perm=[1, 0])  # [M, 1]
            chosen = g.op1("Unsqueeze", [g.op1("GatherND", [rows, index]), ax("zero_ax", [0])])  # [1, M, hidden]
            y = g.op1("Squeeze", [self.mlp(chosen, t, li, f"experts.{e}."), ax("zero_ax", [0])])
            y = g.op1("Mul", [y, g.op1("Unsqueeze", [g.op1("GatherND", [weight, index]), ax("one_ax", [1])])])
            out = g.op1("ScatterND", [out, index, self.residual_precision(y)], reduction="add")  # (in float32)
        out = self.compute_precision(g.op1("Reshape", [out, g.op1("Shape", [xn])]))
        if not m.shared_expert_intermediate_size:
            return out
        # Qwen2-MoE's shared expert: every row, weighted by the sigmoid of its own gate
        gate = np.ascontiguousarray(t["shared_expert_gate"].astype(self.dtype).T)
        weight = g.op1("Sigmoid", [g.op1("MatMul", [xn, g.const(f"l{li}.shared_expert_gate", gate)])])
        return g.op1("Add", [out, g.op1("Mul", [self.mlp(xn, t, li, "shared_expert."), weight])])

    def activation(self, x: str) -> str:
        """The gate's activation: SiLU, or GELU's tanh approximation
        (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))))."""
        g = self.g
        if self.m.activation == "silu":
            return g.op1("Mul", [x, g.op1("Sigmoid", [x])])
        c = lambda name, v: g.const(name, np.array(v, self.dtype))  # noqa: E731 - scalars of the graph's type
        cube = g.op1("Mul", [g.op1("Mul", [x, x]), x])
        inner = g.op1("Mul", [g.op1("Add", [x, g.op1("Mul", [cube, c("gelu_cubic", 0.044715)])]),
                              c("gelu_scale", np.sqrt(2.0 / np.pi))])
        half = g.op1("Mul", [x, c("gelu_half", 0.5)])
        return g.op1("Mul", [half, g.op1("Add", [g.op1("Tanh", [inner]), c("gelu_one", 1.0)])])

    # --- whole graph ----------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        g, m, s = self.g, self.m, self.s
        static = s.flavour == "static"
        head, tail = s.first_layer == 0, s.last_layer == m.n_layers - 1
        fused = self.fused
        b_dim: int | str = "B" if fused else 1
        t_dim: int | str = s.prefill_chunk if static else "T"
        kv_len: int | str = s.max_context if static else ("C" if fused else "P")
        kv_shape = [b_dim, m.n_kv_heads, kv_len, m.head_dim]
        inputs, outputs = [], []
        if head:
            inputs.append(helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b_dim, t_dim]))
            x = self.embed("input_ids")
        else:
            inputs.append(helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [b_dim, t_dim, m.hidden_size]))
            x = "hidden_states"
        if static or fused:
            inputs.append(helper.make_tensor_value_info("past_length", TensorProto.INT64, [b_dim]))
        if static:
            pro = self.prologue_static()
        elif fused:
            pro = self.prologue_cpu(x)
        else:
            pro = self.prologue_portable(x, f"past_key.{s.first_layer}")
        tile = g.const("mask_tile", np.array([m.group_size, 1], np.int64))
        for kind in ("", "sliding"):  # rows of grouped query heads repeat the mask grp times
            if "mask" + kind in pro:
                pro["mask_grouped" + kind] = g.op1("Tile", [pro["mask" + kind], tile])
        residual, pending = x, None
        for li in range(s.first_layer, s.last_layer + 1):
            for kind in ("key", "value"):
                inputs.append(helper.make_tensor_value_info(f"past_{kind}.{li}", self.elem, kv_shape))
            t = self._load(layer_key(li))
            if not m.pre_sublayer_norms:  # the attention reads the residual stream itself
                if pending is not None:
                    residual = g.op1("Add", [self.residual_precision(pending), residual])
                xn = self.compute_precision(residual)
            elif pending is None and fused:
                # Same fused kernel as between layers (skip = 0 is exact): chains stay bit-exact.
                zeros = g.op1("ConstantOfShape", [g.op1("Shape", [residual])],
                              value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
                xn, residual = self.add_rms(zeros, residual, t["input_norm"], f"l{li}.input_norm")
            elif pending is None:
                xn = self.rms(residual, t["input_norm"], f"l{li}.input_norm")  # plain flavours
            else:
                xn, residual = self.add_rms(pending, residual, t["input_norm"], f"l{li}.input_norm")
            att = self.attention_cpu if fused else self.attention_plain
            a, k_out, v_out = att(xn, t, li, self._layer_view(pro, li))
            o = self.linear(a, t, ["o_proj"], f"l{li}.o_proj")
            if m.attention_output_bias:
                o = self.add_bias(o, t, ["o_bias"], f"l{li}.o_proj")
            if m.post_sublayer_norms:
                o = self.rms(self.residual_precision(o), t["attn_out_norm"], f"l{li}.attn_out_norm")
            o = self.scaled(o, m.residual_scale, "residual_scale")
            if m.pre_sublayer_norms:
                xn2, residual = self.add_rms(o, residual, t["post_norm"], f"l{li}.post_norm")
            else:
                residual = g.op1("Add", [self.residual_precision(o), residual])
                xn2 = self.compute_precision(residual)
            pending = self.mlp(xn2, t, li)
            if m.post_sublayer_norms:
                pending = self.rms(self.residual_precision(pending), t["mlp_out_norm"], f"l{li}.mlp_out_norm")
            pending = self.scaled(pending, m.residual_scale, "residual_scale")
            new_len: int | str = s.prefill_chunk if static else ("C" if fused else "P_plus_T")
            for kind, name in (("key", k_out), ("value", v_out)):
                outputs.append(helper.make_tensor_value_info(name, self.elem,
                                                             [b_dim, m.n_kv_heads, new_len, m.head_dim]))
        if tail:
            h = self._load("head")
            if m.shared_table:  # the output layer is the embed file's table, in its 8-bit blocks
                h |= {name.replace("embed.", "lm_head.", 1): value for name, value in self._load("embed").items()}
            normed, _ = self.add_rms(pending, residual, h["norm"], "final_norm")
            if fused:  # logits for positions logits_from.. only: a prompt's sampling needs its last row
                inputs.append(helper.make_tensor_value_info("logits_from", TensorProto.INT64, [1]))
                normed = g.op1("Slice", [normed, "logits_from", g.const("int64_max", np.array([2**63 - 1], np.int64)),
                                         g.const("one_ax", np.array([1], np.int64))])
            hidden = normed if self.elem == TensorProto.FLOAT else g.op1("Cast", [normed], to=TensorProto.FLOAT)
            g.op("Identity", [hidden], out=[FINAL_HIDDEN])  # what an embedding of the prompt reads
            logits = self.scaled(self.linear(normed, h, ["lm_head"], "lm_head"), m.logit_scale, "logit_scale")
            if self.elem != TensorProto.FLOAT:
                logits = g.op1("Cast", [logits], to=TensorProto.FLOAT)
            logits = self.softcapped(logits, m.logit_softcap, "logit_softcap")  # in float32
            g.op("Identity", [logits], out=["logits"])
            rows: int | str = "L" if fused else t_dim
            outputs.insert(0, helper.make_tensor_value_info("logits", TensorProto.FLOAT, [b_dim, rows, m.vocab_size]))
            outputs.append(helper.make_tensor_value_info(FINAL_HIDDEN, TensorProto.FLOAT, [b_dim, rows, m.hidden_size]))
        else:
            g.op("Add", [self.residual_precision(pending), residual], out=["hidden_states_out"])
            outputs.insert(0, helper.make_tensor_value_info("hidden_states_out", TensorProto.FLOAT,
                                                            [b_dim, t_dim, m.hidden_size]))
        graph = helper.make_graph(g.nodes, f"ncm_{m.name}_{s.first_layer}_{s.last_layer}_{s.flavour}",
                                  inputs, outputs, initializer=g.inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="ncm")
        model.ir_version = IR_VERSION
        return model
