"""How long ``ncm import`` takes against reading the file once, and how big the store is.

    python bench/import_speed.py                       # the 1B shape's Q4_0 file (bench/model_shapes.py)
    python bench/import_speed.py FILE.gguf ... --formats auto,q4,f32 --rounds 2

Per file, one run side by side:

- the time to read the file once: from the disk, past the page cache (``O_DIRECT``, where the
  file system has it), and from the page cache;
- per store format (``--formats``; ``auto`` is ``ncm import``'s default, ``mixed`` for a
  quantised file), the import's wall time (best of ``--rounds``), its ratio to the disk read
  (aim <= 3) and the store's bytes over the file's tensor bytes;
- the same block formats with the file's blocks re-quantised from float32 instead of carried
  over as they are (how every import ran before the carry-over), for the ratio between the two.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gguf_reference import gguf_tensor_bytes  # noqa: E402 - after the path
from bench.model_shapes import shape_gguf  # noqa: E402
from shards.importers.importer import import_model  # noqa: E402
from shards.store.manifest import AUTO_WEIGHTS, BLOCK_FORMATS  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402

READ_CHUNK_BYTES = 8 << 20


def read_seconds(path: Path, direct: bool) -> float | None:
    """Seconds to read ``path`` once: past the page cache with ``direct`` (None where the file
    system refuses O_DIRECT), else through it."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    buffer = mmap.mmap(-1, READ_CHUNK_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        start = time.perf_counter()
        while os.readv(fd, [buffer]) == READ_CHUNK_BYTES:
            pass
        return time.perf_counter() - start
    except OSError:
        return None
    finally:
        os.close(fd)
        buffer.close()


def import_seconds(path: Path, weights: str, rounds: int, carried: bool) -> tuple[float, int, str]:
    """(best wall time, store bytes, stored format) of importing ``path`` as ``weights``; with
    ``carried`` false, every block goes through float32 and is quantised again."""
    best, size, stored = float("inf"), 0, weights
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="ncm-import-bench-") as home:
            declined = contextlib.nullcontext() if carried else mock.patch("shards.importers.importer.carry",
                                                                            return_value=None)
            start = time.perf_counter()
            with declined:
                manifest = import_model(path, name="bench", weights=weights, store=ModelStore(Path(home)),
                                        progress=False)
            best = min(best, time.perf_counter() - start)
            size, stored = sum(f.bytes for f in manifest.files.values()), manifest.weight_format
    return best, size, stored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="GGUF files (default: the 1B shape's Q4_0 file)")
    parser.add_argument("--formats", default="auto,q4,f32", help="store formats, comma-separated (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="imports per format, the best one counted")
    parser.add_argument("--no-float-path", action="store_true", help="skip the re-quantised-from-float32 rows")
    args = parser.parse_args(argv)
    files = args.files or [shape_gguf("llama-1b")]
    formats = [f for f in args.formats.split(",") if f]
    for path in files:
        tensor_bytes = gguf_tensor_bytes(path)
        read_seconds(path, direct=False)  # in the page cache, for the cached read's figure
        disk, cached = read_seconds(path, direct=True), read_seconds(path, direct=False)
        reference = disk if disk is not None else cached
        print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, read once in "
              f"{'n/a' if disk is None else f'{disk:.2f} s'} from the disk (O_DIRECT), {cached:.2f} s cached")
        print(f"  {'format':<28} {'import':>8} {'/ read':>7} {'store / file':>13}")
        rows = [(f, True) for f in formats]
        if not args.no_float_path:
            rows += [(f, False) for f in formats if f in (*BLOCK_FORMATS, AUTO_WEIGHTS)]
        for weights, carried in rows:
            seconds, size, stored = import_seconds(path, weights, args.rounds, carried)
            if not carried and stored not in BLOCK_FORMATS:
                continue
            label = (weights if weights == stored else f"{weights} ({stored})") + ("" if carried else ", via float32")
            print(f"  {label:<28} {seconds:>7.2f}s {seconds / reference:>6.1f}x {size / tensor_bytes:>12.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
