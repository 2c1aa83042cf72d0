"""Deadlines stretch with the machine's load (tests/deadlines.py)."""

from __future__ import annotations

import os

import pytest

from tests import deadlines


def test_a_deadline_stretches_while_the_machine_is_busy(monkeypatch):
    cores = os.cpu_count() or 1
    load = [0.5 * cores]
    monkeypatch.setattr(deadlines.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    clock = [100.0]
    monkeypatch.setattr(deadlines.time, "monotonic", lambda: clock[0])
    deadline = deadlines.Deadline(10.0)
    clock[0] = 109.0
    assert not deadline.expired()
    clock[0] = 111.0
    assert deadline.expired()  # a quiet machine: the plain timeout
    busy = deadlines.Deadline(10.0)
    load[0] = 4.0 * cores  # four runnable processes per core while it waits
    clock[0] = 111.0 + 39.0
    assert not busy.expired() and busy.stretch == pytest.approx(4.0)
    load[0] = 0.0  # the load went down again: the stretch it earned stays
    clock[0] = 111.0 + 41.0
    assert busy.expired() and "x4.0" in busy.describe()


def test_the_stretch_is_bounded():
    assert 1.0 <= deadlines.busy_factor() <= deadlines.MAX_STRETCH
