"""MatMulNBits' CPU kernels on this machine: a product's time on float activations
(``accuracy_level`` 0) and on int8 ones (4), for a decode step (1 row), the same taken twice
as the fragments take it (2 rows: x and what rounding it to int8 left), and a prompt's chunk
(128 rows, and 256 taken twice), at the product sizes of SmolLM2 and of the 1B shape.

    python bench/q4_kernels.py [--threads 1]

Each product is one onnxruntime session of one MatMulNBits node (4-bit blocks of 32, no zero
points: a GGUF Q4_0 tensor's form) on random weights; best of ``--repeats`` runs of a batch of
calls. It shows why the fragment builder's choice (``shards/graph/fragment.py``: every 4-bit
product on int8 activations taken once with ``activation_bits`` 8, the default; with 16, float
activations below ``INT8_MIN_WEIGHTS[16]`` weights, int8 ones taken twice above) is what it is on
this CPU: the float kernel is slow for few rows on CPUs without AVX-512, and taking int8 rows
twice doubles a prompt's arithmetic.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

SHAPES = [("SmolLM2 gate/up", 576, 3072), ("SmolLM2 down", 1536, 576), ("1B q/k/v", 2048, 3072),
          ("1B gate/up", 2048, 16384), ("1B down", 8192, 2048)]  # (label, K, N)
ROWS = (1, 2, 128, 256)


def session(k: int, n: int, level: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = k // 32
    weights = numpy_helper.from_array(rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8), "w")
    scales = numpy_helper.from_array((rng.random(n * blocks, dtype=np.float32) * 0.01), "s")
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32, accuracy_level=level)
    graph = helper.make_graph([node], "product", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])], [weights, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def seconds_per_call(run, x: np.ndarray, repeats: int) -> float:
    run(x)
    calls = max(1, int(0.2 / max(_timed(run, x), 1e-6)))
    return min(_timed(run, x, calls) for _ in range(repeats))


def _timed(run, x: np.ndarray, calls: int = 1) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run(x)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {args.threads} thread(s); microseconds per call")
    print(f"{'product':18} {'K x N':>12} {'level':>5} " + " ".join(f"{f'{r} rows':>10}" for r in ROWS))
    rng = np.random.default_rng(1)
    for label, k, n in SHAPES:
        for level in (0, 4):
            sess = session(k, n, level, args.threads)
            times = [seconds_per_call(lambda x: sess.run(None, {"x": x}), rng.standard_normal((1, rows, k), np.float32),
                                      args.repeats) for rows in ROWS]
            print(f"{label:18} {f'{k}x{n}':>12} {level:>5} " + " ".join(f"{1e6 * t:10.1f}" for t in times))


if __name__ == "__main__":
    main()
