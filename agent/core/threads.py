"""How many compute threads a fragment gets, and whether they spin, from what shares the cores.

onnxruntime's intra-op threads spin while they wait for work, within a run (between one
operator and the next) and for a while after it, so the next one starts at once: right for an
agent alone on its device, ruinous for several agents on one host (the demo, the tests, a PC
running two agents) if their idle stages keep spinning and take the cores from the busy one.
There they spin within a run only (the stage that computes keeps its threads hot; a stage
that waits leaves the cores), and a range opens as one session: several sessions of a range
(opened side by side to load faster, onnxruntime repacking each on a core of its own) each
wake their threads at every step, and the agents of a shared host load side by side anyway.
Pure: the agents on the host and the cores are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

SPIN_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class ThreadPlan:
    threads: int | None  # intra-op threads; None lets the runtime choose (all cores)
    spinning: bool  # the threads spin while they wait for work
    spin_after_run: bool  # ... and go on spinning once a run returns, until the next
    reason: str
    load_side_by_side: bool = True  # a range may open as several sessions, one per thread


def thread_plan(*, configured_threads: int, spin: str, agents_on_host: int, cores: int) -> ThreadPlan:
    """Alone on the host: the configured threads (0: the runtime's choice), spinning unless
    ``spin`` is "off". Sharing it with other agents: the cores split evenly between them, and
    spinning within a run only unless ``spin`` is "on" (spinning after it too) or "off" (none);
    configured threads always win."""
    if spin not in SPIN_CHOICES:
        raise ValueError(f"spin must be one of {', '.join(SPIN_CHOICES)}, got {spin!r}")
    agents_on_host, cores = max(1, agents_on_host), max(1, cores)
    spinning = spin != "off"
    if agents_on_host == 1:
        return ThreadPlan(configured_threads or None, spinning, spinning, "alone on this host")
    share = max(1, cores // agents_on_host)
    return ThreadPlan(configured_threads or share, spinning, spin == "on",
                      f"{agents_on_host} agents share this host's {cores} cores", load_side_by_side=False)
