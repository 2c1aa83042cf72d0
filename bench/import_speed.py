"""How long ``ncm import`` takes against reading the file once, and how big the store is.

    python bench/import_speed.py                       # the 1B shape's Q4_0 file (bench/model_shapes.py)
    python bench/import_speed.py FILE.gguf ... --formats auto,q4,f32 --rounds 2

Per file, one run side by side:

- the time to read the file once: from the disk, past the page cache (``O_DIRECT``, where the
  file system has it), and from the page cache;
- the time to write as many bytes once into a new file (the store's writes alone);
- per store format (``--formats``; ``auto`` is ``ncm import``'s default, ``mixed`` for a
  quantised file), the import's wall time (best of ``--rounds``), its ratio to the disk read
  (aim <= 3) and to the write, and the store's bytes over the file's tensor bytes;
- the seconds to load the store once as fragments read it (``load``): a ``mixed`` store keeps
  the file's blocks and shuffles them into ncm's there, once per fragment build;
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
from shards.importers.stored_form import load_stored  # noqa: E402
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


def write_seconds(nbytes: int, directory: Path) -> float:
    """Seconds to write ``nbytes`` once into a new file in ``directory`` (as an import writes
    its store: through the page cache, no fsync; the kernel throttles a writer to the disk's
    pace once the dirty pages pile up)."""
    buffer = os.urandom(READ_CHUNK_BYTES)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="ncm-write-bench-") as f:
        start = time.perf_counter()
        for _ in range(-(-nbytes // READ_CHUNK_BYTES)):
            f.write(buffer)
        return time.perf_counter() - start


def import_seconds(path: Path, weights: str, rounds: int, carried: bool) -> tuple[float, int, str, float]:
    """(best wall time, store bytes, stored format, seconds to load the store once) of importing
    ``path`` as ``weights``; with ``carried`` false, every block goes through float32 and is
    quantised again."""
    best, size, stored, load = float("inf"), 0, weights, 0.0
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="ncm-import-bench-") as home, contextlib.ExitStack() as declined:
            if not carried:
                declined.enter_context(mock.patch("shards.importers.stored_form.carry", return_value=None))
                declined.enter_context(mock.patch("shards.importers.stored_form._shuffled", return_value=False))
            start = time.perf_counter()
            store = ModelStore(Path(home))
            manifest = import_model(path, name="bench", weights=weights, store=store, progress=False)
            best = min(best, time.perf_counter() - start)
            size, stored = sum(f.bytes for f in manifest.files.values()), manifest.weight_format
            declined.close()
            start = time.perf_counter()
            for key in manifest.files:
                load_stored(store.model_dir("bench"), manifest, key)
            load = time.perf_counter() - start
    return best, size, stored, load


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
        written = write_seconds(path.stat().st_size, Path(tempfile.gettempdir()))
        print(f"{path.name}: {path.stat().st_size / 2**20:.0f} MiB, read once in "
              f"{'n/a' if disk is None else f'{disk:.2f} s'} from the disk (O_DIRECT), {cached:.2f} s cached; "
              f"as many bytes written once in {written:.2f} s")
        print(f"  {'format':<28} {'import':>8} {'/ read':>7} {'/ write':>8} {'store / file':>13} {'load':>8}")
        rows = [(f, True) for f in formats]
        if not args.no_float_path:
            rows += [(f, False) for f in formats if f in (*BLOCK_FORMATS, AUTO_WEIGHTS)]
        for weights, carried in rows:
            seconds, size, stored, load = import_seconds(path, weights, args.rounds, carried)
            if not carried and stored not in BLOCK_FORMATS:
                continue
            label = (weights if weights == stored else f"{weights} ({stored})") + ("" if carried else ", via float32")
            print(f"  {label:<28} {seconds:>7.2f}s {seconds / reference:>6.1f}x {seconds / written:>7.1f}x "
                  f"{size / tensor_bytes:>12.2f}x {load:>7.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
