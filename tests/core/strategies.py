"""Hypothesis strategies for random clusters."""

from __future__ import annotations

from hypothesis import strategies as st

from agent.core.capacity import NodeCapacity, score

NODE_IDS = st.text(alphabet="abcdefghjkmnpqrstuvwxyz0123456789-", min_size=1, max_size=8)

capacities = st.builds(
    NodeCapacity,
    node_id=NODE_IDS,
    vram_gib=st.one_of(st.just(0.0), st.floats(0, 96)),
    ram_gib=st.one_of(st.just(0.0), st.floats(0, 256)),
    npu_tops=st.one_of(st.just(0.0), st.floats(0, 100)),
    latency_ms=st.one_of(st.just(0.0), st.floats(0, 500)),
    load=st.floats(0, 1),
)


@st.composite
def cluster_scores(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 64) -> dict[str, float]:
    """node id -> score: from random capacities (zero-capacity nodes included) or equal scores."""
    ids = draw(st.lists(NODE_IDS, min_size=min_nodes, max_size=max_nodes, unique=True))
    kind = draw(st.sampled_from(["capacity", "equal", "small-set"]))
    if kind == "equal":
        value = draw(st.floats(1e-3, 100))
        return {node_id: value for node_id in ids}
    if kind == "small-set":
        values = draw(st.lists(st.sampled_from([1e-3, 1.0, 2.0, 7.5]), min_size=len(ids), max_size=len(ids)))
        return dict(zip(ids, values))
    nodes = [draw(capacities.map(lambda c, n=node_id: NodeCapacity(n, c.vram_gib, c.ram_gib, c.npu_tops, c.latency_ms, c.load))) for node_id in ids]
    return {node.node_id: score(node) for node in nodes}
