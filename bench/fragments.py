"""Disk use of the fragment cache: the fragments of every even split over 1..N devices.

Builds, in a temporary cache, the fragments a device would accumulate as the cluster around
it changes size (every range of every even split of the model over 1..N devices), then
reports the bytes those fragments hold one by one (what a cache without shared blobs would
take), the bytes really on disk (each hard-linked blob counted once) and the model's own
weights, with the build time of each pass.

    python bench/fragments.py [--model smollm2-135m] [--devices 5] [--flavour cpu]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.cli.demo import _ensure_model  # noqa: E402
from shards.graph.fragment import build_fragment, load_manifest  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402


def even_split(n_layers: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def disk_bytes(root: Path) -> tuple[int, int]:
    """(sum of the sizes of the fragments' files, bytes on disk counting each inode once)."""
    apparent, inodes = 0, {}
    for path in root.rglob("*"):
        if path.is_file() and path.parent.name != ".blobs":
            st = path.stat()
            apparent += st.st_size
            inodes[st.st_ino] = st.st_size
    return apparent, sum(inodes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--devices", type=int, default=5)
    parser.add_argument("--flavour", default="cpu")
    args = parser.parse_args()
    _ensure_model(args.model)
    model_dir = ModelStore().model_dir(args.model)
    m = load_manifest(model_dir)
    weights = sum(f.bytes for f in m.files.values())
    print(f"{args.model}: {m.n_layers} layers, weights {weights / 2**20:.0f} MiB")
    with tempfile.TemporaryDirectory(prefix="ncm-bench-fragments-") as tmp:
        cache = Path(tmp)
        for parts in range(1, args.devices + 1):
            started = time.perf_counter()
            for first, last in even_split(m.n_layers, parts):
                build_fragment(model_dir, first, last, flavour=args.flavour, cache_dir=cache)
            seconds = time.perf_counter() - started
            apparent, on_disk = disk_bytes(cache)
            print(f"after splits over 1..{parts} devices: built in {seconds:6.1f} s   fragments "
                  f"{apparent / 2**20:7.0f} MiB one by one, {on_disk / 2**20:6.0f} MiB on disk "
                  f"({on_disk / weights:.2f} x the weights)")


if __name__ == "__main__":
    main()
