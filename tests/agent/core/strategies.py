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


# Figures (VRAM GiB, RAM GiB, NPU TOPS) grouped by equal 8·VRAM + 2·RAM + 6·NPU: different
# figures with exactly equal scores, the ties that floating point used to break by noise.
EQUAL_SCORE_FIGURES = (
    ((0, 6, 0), (1, 2, 0), (0, 3, 1), (0, 0, 2)),
    ((3, 0, 0), (2, 1, 1), (1, 8, 0), (0, 3, 3), (2, 4, 0), (1, 5, 1), (0, 9, 1), (0, 0, 4)),
    ((1, 0, 0), (0, 4, 0), (0, 1, 1)),
    ((0, 1, 0),),
    ((0, 0, 0),),
)

_figures = st.one_of(
    st.tuples(st.integers(0, 4), st.integers(0, 8), st.integers(0, 3)),
    st.sampled_from([figures for group in EQUAL_SCORE_FIGURES for figures in group]),
)


@st.composite
def integer_clusters(draw: st.DrawFn, min_nodes: int = 1, max_nodes: int = 8, loads: bool = True) -> list[NodeCapacity]:
    """Nodes with small whole GiB and TOPS, latency 0 and a few round loads: many exact ties."""
    ids = draw(st.lists(NODE_IDS, min_size=min_nodes, max_size=max_nodes, unique=True))
    load = st.sampled_from([0.0, 0.1, 0.5, 1.0]) if loads else st.just(0.0)
    nodes = []
    for node_id in ids:
        vram, ram, npu = draw(_figures)
        nodes.append(NodeCapacity(node_id, vram_gib=vram, ram_gib=ram, npu_tops=npu, latency_ms=0, load=draw(load)))
    return nodes
