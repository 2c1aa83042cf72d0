"""How many compute threads a fragment gets, and whether they spin, from what shares the cores.

onnxruntime's intra-op threads spin for a while after each run so the next one starts at once:
right for an agent alone on its device, ruinous for several agents on one host (the demo, the
tests, a PC running two agents), whose idle stages' spinning takes the cores from the busy
one. Pure: the agents on the host and the cores are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

SPIN_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class ThreadPlan:
    threads: int | None  # intra-op threads; None lets the runtime choose (all cores)
    spinning: bool
    reason: str


def thread_plan(*, configured_threads: int, spin: str, agents_on_host: int, cores: int) -> ThreadPlan:
    """Alone on the host: the configured threads (0: the runtime's choice) spinning, unless
    ``spin`` is "off". Sharing it with other agents: the cores split evenly between them and no
    spinning, unless ``spin`` is "on"; configured threads always win."""
    if spin not in SPIN_CHOICES:
        raise ValueError(f"spin must be one of {', '.join(SPIN_CHOICES)}, got {spin!r}")
    agents_on_host, cores = max(1, agents_on_host), max(1, cores)
    if agents_on_host == 1:
        return ThreadPlan(configured_threads or None, spin != "off", "alone on this host")
    share = max(1, cores // agents_on_host)
    return ThreadPlan(configured_threads or share, spin == "on",
                      f"{agents_on_host} agents share this host's {cores} cores")
