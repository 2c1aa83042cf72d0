"""The RKNN converter and simulator, run in the converter's own environment.

Rockchip's ``rknn-toolkit2`` pins old numpy, onnx and protobuf, so it cannot live in ncm's
environment: ``ncm`` runs this file with the interpreter of an environment that has it
(:func:`shards.providers.rknn.converter_python`). It imports nothing of ncm, only the toolkit, numpy
and the standard library.

    python rknn_worker.py convert FRAGMENT.onnx OUT.rknn --target rk3588
        convert a static-flavour fragment to an .rknn file for the board's NPU (fp16).
    python rknn_worker.py simulate FRAGMENT.onnx --target rk3588
        convert it and run it on the toolkit's simulator (x86): requests on stdin, answers on
        stdout, each frame an 8-byte little-endian length and an .npz of arrays named
        "0", "1", ... in the graph's input (answer: output) order. A failed request is answered
        with one array "error" holding the message; the worker goes on.

Failures print one line to stderr, ``rknn: <what failed>: <the toolkit's message>``, and exit 1.
"""

from __future__ import annotations

import argparse
import io
import os
import struct
import sys

# Run as a file, this folder would come first on the import path, and its rknn.py would hide
# the toolkit's rknn package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != os.path.dirname(os.path.abspath(__file__))]
FLOAT_DTYPE = "float16"
_LENGTH = struct.Struct("<Q")


def _fail(what: str, detail: object = None) -> None:
    line = f"rknn: {what}"
    if detail is not None and str(detail).strip():
        line += f": {str(detail).strip().splitlines()[-1]}"
    print(line, file=sys.stderr, flush=True)
    sys.exit(1)


def _frames_out() -> io.BufferedWriter:
    """Standard output for frames alone: whatever else writes to it (the toolkit's progress,
    from Python or C) goes to standard error from now on."""
    frames = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return frames


def _build(onnx_path: str, target: str, *, verbose: bool) -> object:
    try:
        from rknn.api import RKNN
    except ImportError as error:
        _fail("rknn-toolkit2 is not installed in this environment", error)
    rknn = RKNN(verbose=verbose)
    if rknn.config(target_platform=target, float_dtype=FLOAT_DTYPE) != 0:
        _fail(f"the toolkit does not take target {target!r}")
    if rknn.load_onnx(model=onnx_path) != 0:
        _fail(f"the converter cannot load {os.path.basename(onnx_path)} (the toolkit's log above says why)")
    if rknn.build(do_quantization=False) != 0:
        _fail(f"the converter refused {os.path.basename(onnx_path)} for {target} (the toolkit's log above says why)")
    return rknn


def convert(onnx_path: str, out_path: str, target: str) -> None:
    rknn = _build(onnx_path, target, verbose=False)
    if rknn.export_rknn(out_path) != 0:
        _fail(f"cannot write {out_path}")
    rknn.release()


def _read_frame(stream: io.BufferedReader) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    return stream.read(length)


def _write_frame(stream: io.BufferedWriter, arrays: dict[str, object]) -> None:
    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    payload = buffer.getvalue()
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def simulate(onnx_path: str, target: str) -> None:
    import numpy as np

    stdout = _frames_out()
    rknn = _build(onnx_path, target, verbose=False)
    if rknn.init_runtime() != 0:  # no target: the simulator
        _fail("the simulator did not start")
    stdin = sys.stdin.buffer
    _write_frame(stdout, {"ready": np.array(1)})
    while (frame := _read_frame(stdin)) is not None:
        with np.load(io.BytesIO(frame)) as data:
            inputs = [data[str(i)] for i in range(len(data.files))]
        try:
            # every input as it is (4-D caches are not images: no layout change)
            outputs = rknn.inference(inputs=inputs, data_format=["nchw"] * len(inputs))
            if outputs is None:
                raise RuntimeError("the simulator returned no outputs (see its log)")
            _write_frame(stdout, {str(i): np.asarray(o) for i, o in enumerate(outputs)})
        except Exception as error:  # noqa: BLE001 - answered to the caller, the worker goes on
            _write_frame(stdout, {"error": np.array(f"{type(error).__name__}: {error}")})
    rknn.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rknn_worker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert")
    p.add_argument("onnx")
    p.add_argument("out")
    p.add_argument("--target", default="rk3588")
    p = sub.add_parser("simulate")
    p.add_argument("onnx")
    p.add_argument("--target", default="rk3588")
    args = parser.parse_args(argv)
    if args.command == "convert":
        convert(args.onnx, args.out, args.target)
    else:
        simulate(args.onnx, args.target)


if __name__ == "__main__":
    main()
