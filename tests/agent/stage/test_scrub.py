"""The background scrub, in-process agents serving the tiny model: a byte that flips in a
stored weight file with its modification time kept (what a failing SD card does) is found by
the scrub within its period, the file is fetched again from a peer and the repair reported;
a corrupt fragment blob is dropped with the fragments that use it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agent.http.app_keys import EVENTS, SCRUBBER, STORE, WORKER
from agent.stage.scrub import next_scrub_s
from shards.graph.fragment import BLOB_POOL, FRAGMENTS_DIR
from shards.store.verify import hash_file, intact
from tests.agent.inprocess import eventually
from tests.agent.tiny import TINY, tiny_cluster


def flip_a_byte_keeping_the_mtime(path: Path) -> None:
    stat = path.stat()
    with path.open("r+b") as handle:
        handle.seek(stat.st_size // 2)
        byte = handle.read(1)
        handle.seek(stat.st_size // 2)
        handle.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_bit_rot_is_found_by_the_scrub_and_the_file_fetched_again(tmp_path):
    (tmp_path / "agent-1").mkdir()
    (tmp_path / "agent-1" / "running").write_text("4242\n")  # agent 1 did not stop cleanly last time

    async def scenario() -> None:
        async with tiny_cluster(tmp_path, 2, scrub_interval_s=2.0) as (leader, others):
            agents = {agent.node_id: agent for agent in (leader, *others)}
            assert agents["node-1"].app[SCRUBBER].unclean_stop and not agents["node-0"].app[SCRUBBER].unclean_stop
            node = agents["node-1"]  # it fetched its layers from node-0, which holds the model
            store, worker = node.app[STORE], node.app[WORKER]
            await eventually(lambda: TINY in worker.serving, timeout_s=30, what="the node serving its layers")
            model_dir = store.models_dir / TINY
            manifest = store.manifest(TINY)
            entry = next(e for e in manifest.files.values() if (model_dir / e.path).is_file() and e.bytes > 64)
            path = model_dir / entry.path
            assert intact(model_dir, entry)
            blob = sorted((model_dir / FRAGMENTS_DIR / BLOB_POOL).iterdir())[0]
            flip_a_byte_keeping_the_mtime(path)
            flip_a_byte_keeping_the_mtime(blob)
            assert intact(model_dir, entry)  # size and mtime unchanged: the verification cache cannot see it

            def repaired():
                return [r for r in worker.status()["repairs"] if r.get("found_by") == "scrub"]
            await eventually(repaired, timeout_s=30, what="the scrub to find the flipped byte")
            assert repaired() == [{"model": TINY, "files": [entry.path], "fetched_again": True, "found_by": "scrub"}]
            assert hash_file(path).hexdigest() == entry.sha256 and intact(model_dir, entry)
            await eventually(lambda: not blob.exists(), timeout_s=30, what="the corrupt blob dropped")
            assert not any((d / f"{blob.name}.bin").exists() for d in (model_dir / FRAGMENTS_DIR).iterdir())
            assert [event.kind for event in node.app[EVENTS].history].count("corrupt") >= 2

    asyncio.run(scenario())


def test_the_scrub_comes_within_its_period_and_soon_after_an_unclean_stop():
    assert next_scrub_s(now_s=1000.0, last_s=None, interval_s=86400.0, unclean_stop=False) == 86400.0
    assert next_scrub_s(now_s=1000.0, last_s=900.0, interval_s=600.0, unclean_stop=False) == 500.0
    assert next_scrub_s(now_s=1000.0, last_s=100.0, interval_s=600.0, unclean_stop=False) == 0.0
    assert next_scrub_s(now_s=1000.0, last_s=900.0, interval_s=600.0, unclean_stop=True) == 60.0
    assert next_scrub_s(now_s=1000.0, last_s=900.0, interval_s=5.0, unclean_stop=True) == 5.0
