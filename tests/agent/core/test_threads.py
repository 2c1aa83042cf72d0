"""Threads and spinning per agent, from what shares the host's cores (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.threads import SPIN_CHOICES, thread_plan


def test_alone_an_agent_keeps_the_runtime_choice_and_spins():
    plan = thread_plan(configured_threads=0, spin="auto", agents_on_host=1, cores=8)
    assert (plan.threads, plan.spinning, plan.spin_after_run) == (None, True, True) and "alone" in plan.reason
    assert plan.load_side_by_side  # a range may open as one session per core: it loads faster


def test_agents_sharing_a_host_split_its_cores_and_spin_within_a_run_only():
    plan = thread_plan(configured_threads=0, spin="auto", agents_on_host=3, cores=2)
    assert (plan.threads, plan.spinning, plan.spin_after_run) == (1, True, False) and "3 agents" in plan.reason
    # one session per range: the agents load side by side anyway, and each session wakes its threads per step
    assert not thread_plan(configured_threads=2, spin="auto", agents_on_host=3, cores=2).load_side_by_side
    assert thread_plan(configured_threads=0, spin="auto", agents_on_host=2, cores=16).threads == 8


def test_what_the_operator_sets_wins():
    assert thread_plan(configured_threads=4, spin="on", agents_on_host=3, cores=2).spin_after_run is True
    assert thread_plan(configured_threads=4, spin="auto", agents_on_host=3, cores=2).threads == 4
    assert thread_plan(configured_threads=0, spin="off", agents_on_host=1, cores=2).spinning is False
    with pytest.raises(ValueError, match="spin must be one of"):
        thread_plan(configured_threads=0, spin="sometimes", agents_on_host=1, cores=2)


@given(threads=st.integers(0, 64), spin=st.sampled_from(SPIN_CHOICES), agents=st.integers(0, 32),
       cores=st.integers(0, 256))
def test_never_more_threads_per_agent_than_its_share_unless_configured(threads, spin, agents, cores):
    plan = thread_plan(configured_threads=threads, spin=spin, agents_on_host=agents, cores=cores)
    if threads:
        assert plan.threads == threads
    elif agents > 1:
        assert 1 <= plan.threads <= max(1, cores // agents) and plan.threads * agents <= max(cores, agents)
    assert plan.spinning == (spin != "off")
    assert plan.spin_after_run == (spin == "on" or (spin == "auto" and agents <= 1))
    assert plan.load_side_by_side == (agents <= 1)
