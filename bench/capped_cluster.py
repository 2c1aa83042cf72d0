"""A model no single device can hold: agents in memory-capped control groups, each below the
model's size, serve it together.

    python bench/capped_cluster.py                          # the 8B shape's Q4_K_M file, 3 agents, 3 GiB each
    python bench/capped_cluster.py --memory-max-gib 2.5 --tokens 32 --threads 2

Needs root and a writable cgroup hierarchy (v2, or v1's memory controller): each agent runs in
a group of its own whose limit (``memory.max`` / ``memory.limit_in_bytes``, what systemd's
``MemoryMax=`` sets) is below the model's size, so past its limit the kernel would kill it.

1. The shape's GGUF (bench/model_shapes.py, written once) is imported as ``ncm import`` does
   by default (the mixed store): the import's wall time against reading the file once, its
   peak RSS, and the store's size.
2. ``--nodes`` agents on loopback, each in its group, the first one holding the store (the
   others fetch the layers the plan gives them from it). Per agent: the memory it advertises
   once loaded (within its cgroup's limit, not the machine's; what its models hold counted as
   usable), the layers and bytes it holds (its share: fragments and KV budget), its peak RSS
   (sampled) against its share and the limit, its group's peak charge (page cache included:
   the kernel drops cache to stay within the limit), the group's OOM kills, and while it
   decodes its major page faults (pages read again from the disk: weights the limit pushed
   out) and the times its charge hit the limit (the kernel reclaimed before it could give the
   agent memory).
3. Greedy decode tokens/s of a stream of ``--tokens`` tokens (best of ``--rounds``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from agent.cli.demo import local_agents, stop_processes, wait_ready  # noqa: E402 - after the path
from agent.cli.http_client import http_json  # noqa: E402
from bench.cluster import PROMPT, stream_completion  # noqa: E402
from bench.gguf_reference import gguf_tensor_bytes  # noqa: E402
from bench.import_speed import read_seconds  # noqa: E402
from bench.model_shapes import cache_dir, shape_gguf  # noqa: E402
from shards.importers.importer import import_model  # noqa: E402
from shards.store.manifest import AUTO_WEIGHTS  # noqa: E402
from shards.store.model_store import ModelStore  # noqa: E402

GIB = 1024**3
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CappedGroup:
    """A memory cgroup of its own with ``limit_bytes`` (v2 where the machine has it, else v1)."""

    def __init__(self, limit_bytes: int) -> None:
        name = f"ncm-bench-{uuid.uuid4().hex[:8]}"
        self.v2 = (CGROUP_ROOT / "cgroup.controllers").is_file()
        if self.v2:
            own = Path("/proc/self/cgroup").read_text().splitlines()[0].split(":", 2)[2]
            self.folder = CGROUP_ROOT / own.lstrip("/") / name
        else:
            self.folder = CGROUP_ROOT / "memory" / name
        self.folder.mkdir()
        (self.folder / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit_bytes))
        self.limit_bytes = limit_bytes

    def enter(self) -> None:
        """Move the calling process (a child before its exec) into the group."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        path = self.folder / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(path.read_text()) if path.is_file() else None

    def oom_kills(self) -> int:
        """Processes of the group the kernel killed for want of memory."""
        text = (self.folder / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        fields = dict(line.split() for line in text.splitlines())
        return int(fields.get("oom_kill", 0))

    def major_faults(self) -> int:
        """Page faults of the group that read from the disk: weights dropped and read again."""
        text = (self.folder / "memory.stat").read_text()
        fields = dict(line.split() for line in text.splitlines())
        return int(fields.get("pgmajfault" if self.v2 else "total_pgmajfault", 0))

    def limit_hits(self) -> int:
        """Times the group's charge reached its limit and the kernel had to reclaim first."""
        if self.v2:
            fields = dict(line.split() for line in (self.folder / "memory.events").read_text().splitlines())
            return int(fields.get("max", 0))
        return int((self.folder / "memory.failcnt").read_text())

    def remove(self) -> None:
        try:
            self.folder.rmdir()
        except OSError:
            pass


class PeakRss:
    """Samples the peak resident set of some processes until stopped."""

    def __init__(self, pids: list[int], interval_s: float = 0.2) -> None:
        self.peaks = {pid: 0 for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for pid in self.peaks:
                try:
                    self.peaks[pid] = max(self.peaks[pid], psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass

    def stop(self) -> dict[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def import_store(path: Path, home: Path, name: str) -> dict:
    """Import ``path`` once into ``home`` as ``ncm import`` does by default; its figures."""
    store = ModelStore(home)
    tensor_bytes = gguf_tensor_bytes(path)
    disk = read_seconds(path, direct=True) or read_seconds(path, direct=False)
    seconds = None
    if not store.has(name):
        start = time.perf_counter()
        import_model(path, name=name, weights=AUTO_WEIGHTS, store=store, progress=False)
        seconds = time.perf_counter() - start
    manifest = store.manifest(name)
    return {"file_bytes": path.stat().st_size, "tensor_bytes": tensor_bytes, "read_s": disk, "import_s": seconds,
            "import_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "store_bytes": sum(f.bytes for f in manifest.files.values()), "format": manifest.weight_format}


def agent_view(port: int, model: str) -> dict:
    """What an agent says of itself: the memory it advertised and what it holds of ``model``."""
    me = http_json("GET", f"http://127.0.0.1:{port}/cluster/nodes", timeout_s=30.0)["nodes"][0]
    held = me["worker"]["models"].get(model, {})
    return {"id": me["id"], "ram_gib": me["capacity"]["ram_gib"], "memory_bytes": held.get("memory_bytes", 0),
            "fragments": held.get("fragments", [])}


def serve(nodes: int, groups: list[CappedGroup] | None, model: str, home: Path, args: argparse.Namespace) -> dict:
    """``nodes`` agents serving ``model`` (each in its group, with ``groups``): what each holds,
    their peak RSS, the decode rates and the text."""
    with tempfile.TemporaryDirectory(prefix="ncm-capped-") as base:
        agents = local_agents(nodes, args.port, Path(base), model, env={"NCM_THREADS": str(args.threads)},
                              node_env=[{"NCM_HOME": str(home)}], log_dir=Path(base) / "logs")
        processes = []
        for index, agent in enumerate(agents):
            agent.log_path.parent.mkdir(parents=True, exist_ok=True)
            processes.append(subprocess.Popen(agent.argv, env=agent.env, stdout=agent.log_path.open("ab"),
                                              stderr=subprocess.STDOUT,
                                              preexec_fn=groups[index].enter if groups else None))
        sampler = PeakRss([p.pid for p in processes])
        url = f"http://127.0.0.1:{args.port}"
        try:
            start = time.perf_counter()
            wait_ready(url, processes, 3600)
            ready_s = time.perf_counter() - start
            stream_completion(url, model, PROMPT, 4)  # warm-up
            before = [(group.major_faults(), group.limit_hits()) for group in groups or ()]
            rates, text = [], ""
            for _ in range(args.rounds):
                text, stamps = stream_completion(url, model, PROMPT, args.tokens)
                rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            during = [(group.major_faults() - faults, group.limit_hits() - hits)
                      for group, (faults, hits) in zip(groups or (), before)]
            views = [agent_view(agent.port, model) for agent in agents]  # capacity re-measured since the load
        except Exception:
            for agent in agents:
                print(f"--- {agent.log_path.name}\n" + agent.log_path.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            peaks = sampler.stop()
            stop_processes(processes)
    return {"ready_s": ready_s, "views": views, "peaks": [peaks[p.pid] for p in processes], "rate": max(rates),
            "text": text, "decode": during}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--memory-max-gib", type=float, default=3.0, help="each agent's cgroup limit")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads per agent")
    parser.add_argument("--port", type=int, default=18700)
    parser.add_argument("--no-single", action="store_true", help="skip the one uncapped agent run after the cluster")
    args = parser.parse_args(argv)

    path = shape_gguf(args.shape)
    model, home = f"bench-{args.shape}-mixed", cache_dir() / "home"
    figures = import_store(path, home, model)
    import_line = ("already in the store" if figures["import_s"] is None else
                   f"{figures['import_s']:.1f} s ({figures['import_s'] / figures['read_s']:.1f}x reading the file "
                   f"once, {figures['read_s']:.1f} s), peak RSS {figures['import_peak_rss'] / GIB:.2f} GiB")
    print(f"{path.name}: {figures['file_bytes'] / GIB:.2f} GiB; import ({figures['format']}): {import_line}; "
          f"store {figures['store_bytes'] / GIB:.2f} GiB ({figures['store_bytes'] / figures['tensor_bytes']:.2f}x "
          "the file's tensors)", flush=True)

    limit = int(args.memory_max_gib * GIB)
    groups = [CappedGroup(limit) for _ in range(args.nodes)]
    try:
        capped = serve(args.nodes, groups, model, home, args)
        print(f"{args.nodes} agents, each in a cgroup limited to {args.memory_max_gib:g} GiB "
              f"({args.memory_max_gib * GIB / figures['file_bytes']:.2f}x the file); ready in {capped['ready_s']:.0f} s")
        print(f"  {'agent':<6} {'advertised':>10} {'layers':<14} {'share':>9} {'peak RSS':>9} {'/ share':>8} "
              f"{'/ limit':>8} {'cgroup peak':>11} {'OOM kills':>9} {'decode: faults':>14} {'limit hits':>10}")
        for index, (view, rss, group, (faults, hits)) in enumerate(zip(capped["views"], capped["peaks"], groups,
                                                                       capped["decode"])):
            share, charged = view["memory_bytes"], group.peak_bytes()
            layers = ", ".join(f"{f['layers'][0]}-{f['layers'][1]}" for f in view["fragments"]) or "-"
            charged_text = "n/a" if charged is None else f"{charged / GIB:.2f} GiB"
            print(f"  {index:<6} {view['ram_gib']:>6.2f} GiB {layers:<14} {share / GIB:>5.2f} GiB {rss / GIB:>5.2f} GiB "
                  f"{rss / share if share else float('nan'):>7.2f}x {rss / limit:>8.2f} {charged_text:>11} "
                  f"{group.oom_kills():>9} {faults:>14} {hits:>10}")
    finally:
        for group in groups:
            group.remove()
    print(f"decode, {args.nodes} capped agents: {capped['rate']:.2f} tok/s (best of {args.rounds}, {args.tokens} tokens, "
          f"{args.threads} threads per agent)", flush=True)
    if not args.no_single:
        single = serve(1, None, model, home, args)
        print(f"decode, 1 uncapped agent:  {single['rate']:.2f} tok/s, peak RSS {single['peaks'][0] / GIB:.2f} GiB; "
              f"cluster / one agent {capped['rate'] / single['rate']:.2f}; same text: {single['text'] == capped['text']}")
    print(f"text: {json.dumps(capped['text'][:120])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
