"""Where a layer range is cut to open in parts side by side (pure): each part's onnxruntime
session repacks its weights on one core, so ranges that cost as much open as fast."""

from __future__ import annotations

from collections.abc import Sequence

from shards.errors import RunnerError
from shards.store.manifest import Manifest

MAX_LOAD_PARTS = 4  # a range opens as at most this many runners side by side (one per core)


def layer_load_costs(m: Manifest) -> list[int]:
    """What opening each layer costs, in weights onnxruntime repacks (the layer's products; the
    last layer's session also holds the output layer's): the measure that :func:`balanced_cuts`
    evens out, since a session's repack of its weights is most of its load."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    return [layer] * (m.n_layers - 1) + [layer + m.vocab_size * m.hidden_size]


def balanced_cuts(costs: Sequence[float], parts: int, first_layer: int = 0) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges tiling layers first_layer..first_layer + len(costs) - 1 (one
    cost each), every boundary where the running cost comes nearest to an equal share: a range
    costs at most a share plus the largest layer's cost. Equal costs give sizes that differ by
    one at most."""
    n = len(costs)
    if n < 1 or parts < 1:
        raise RunnerError(f"cannot cut {n} layers into {parts} parts")
    parts = min(parts, n)
    running = [0.0]
    for cost in costs:
        running.append(running[-1] + float(cost))
    bounds = [0]
    for i in range(1, parts):
        share = running[-1] * i / parts
        bounds.append(min(range(bounds[-1] + 1, n - parts + i + 1), key=lambda b: abs(running[b] - share)))
    bounds.append(n)
    return [(first_layer + bounds[i], first_layer + bounds[i + 1] - 1) for i in range(parts)]


def load_cuts(m: Manifest, first_layer: int, last_layer: int, parts: int) -> list[tuple[int, int]]:
    """Layers first_layer..last_layer of ``m`` in ``parts`` ranges that take as long to open."""
    return balanced_cuts(layer_load_costs(m)[first_layer:last_layer + 1], parts, first_layer)
