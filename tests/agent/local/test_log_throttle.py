"""agent.local.log_throttle: a warning strangers can cause is logged at once the first time,
then counted; the first one after the interval logs the count (with the number of addresses
and the latest) in one line, and a quiet interval starts afresh. The clock is a parameter: the
tests move it by hand. For any flood, the lines logged stay at one per interval and every
warning is either logged or counted in a later line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.local.log_throttle import ThrottledWarning

SUMMARY = re.compile(r"^refused invite: (\d+) more in the last (\d+) s from (\d+) address\(es\); "
                     r"the latest from (\S+): (.*)$")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """The lines a logger wrote, as a log file would hold them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def lines(self) -> list[str]:
        return [record.getMessage() for record in self.records]


@pytest.fixture
def lines() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("tests.log_throttle")
    logger.addHandler(handler)
    logger.propagate = False
    yield handler
    logger.removeHandler(handler)
    logger.propagate = True


def throttled(clock: Clock, interval_s: float = 60.0) -> ThrottledWarning:
    return ThrottledWarning(logging.getLogger("tests.log_throttle"), "refused invite", interval_s=interval_s,
                            clock=clock)


def test_the_first_warning_is_logged_at_once_as_a_warning(lines: Lines) -> None:
    clock = Clock()
    throttled(clock).warn("10.0.0.7", "unknown invite")
    assert lines.lines == ["refused invite from 10.0.0.7: unknown invite"]
    assert lines.records[0].levelno == logging.WARNING


def test_warnings_within_the_interval_are_counted_and_summed_up_by_the_next_after_it(lines: Lines) -> None:
    clock = Clock()
    warning = throttled(clock)
    warning.warn("10.0.0.7", "first")
    for n, source in enumerate(["10.0.0.8", "10.0.0.9", "10.0.0.8", "10.0.0.7"], start=1):
        clock.now = 1000.0 + n * 10
        warning.warn(source, f"flood {n}")
    assert len(lines.lines) == 1
    clock.now = 1075.0
    warning.warn("10.0.0.42", "the latest")
    assert lines.lines[1:] == ["refused invite: 4 more in the last 75 s from 3 address(es); "
                               "the latest from 10.0.0.42: the latest"]


def test_the_interval_is_reached_at_exactly_interval_s(lines: Lines) -> None:
    clock = Clock()
    warning = throttled(clock, interval_s=5.0)
    warning.warn("a", "one")
    clock.now += 4.999
    warning.warn("a", "held")
    assert len(lines.lines) == 1
    clock.now = 1005.0
    warning.warn("b", "two")
    assert lines.lines[1] == "refused invite: 1 more in the last 5 s from 1 address(es); the latest from b: two"


def test_after_a_summary_a_new_interval_starts_and_its_warnings_are_counted_again(lines: Lines) -> None:
    clock = Clock()
    warning = throttled(clock)
    warning.warn("a", "first")
    clock.now += 1
    warning.warn("b", "held 1")
    clock.now += 60
    warning.warn("c", "summary 1")  # logged: the interval starts here
    clock.now += 30
    warning.warn("d", "held 2")
    warning.warn("d", "held 3")
    assert len(lines.lines) == 2
    clock.now += 30
    warning.warn("e", "summary 2")
    assert lines.lines[2] == "refused invite: 2 more in the last 60 s from 1 address(es); the latest from e: summary 2"


def test_a_warning_after_a_quiet_interval_is_logged_whole_as_a_first_one(lines: Lines) -> None:
    clock = Clock()
    warning = throttled(clock)
    warning.warn("a", "one")
    clock.now += 61
    warning.warn("b", "two")
    clock.now += 3600
    warning.warn("c", "three")
    assert lines.lines == ["refused invite from a: one", "refused invite from b: two", "refused invite from c: three"]


def test_the_addresses_remembered_are_bounded_while_the_count_is_not(lines: Lines) -> None:
    clock = Clock()
    warning = throttled(clock)
    warning.warn("first", "x")
    for n in range(3000):
        warning.warn(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", "flood")
    clock.now += 60
    warning.warn("last", "y")
    assert lines.lines[-1] == ("refused invite: 3000 more in the last 60 s from 1024 address(es); "
                               "the latest from last: y")


def test_each_throttle_counts_apart(lines: Lines) -> None:
    clock = Clock()
    invites, internal = throttled(clock), throttled(clock)
    invites.warn("a", "bad invite")
    internal.warn("a", "unsigned request")  # its own first: logged too
    invites.warn("a", "held")
    assert lines.lines == ["refused invite from a: bad invite", "refused invite from a: unsigned request"]


QUARTERS = st.integers(0, 120).map(lambda n: n / 4)  # exact in binary: the clock's sums are too


@given(st.lists(st.tuples(QUARTERS, st.sampled_from(["a", "b", "c"])), min_size=1, max_size=60),
       st.integers(4, 80).map(lambda n: n / 4))
def test_a_flood_logs_at_most_a_line_per_interval_and_accounts_for_every_warning(
        flood: list[tuple[float, str]], interval_s: float) -> None:
    handler = Lines()
    logger = logging.getLogger("tests.log_throttle.property")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        clock = Clock()
        warning = ThrottledWarning(logger, "refused invite", interval_s=interval_s, clock=clock)
        logged_at: list[float] = []
        for step, source in flood:
            clock.now += step
            before = len(handler.records)
            warning.warn(source, "m")
            if len(handler.records) > before:
                logged_at.append(clock.now)
        clock.now += interval_s  # one more after the last interval tells what was still held
        before = len(handler.records)
        warning.warn("z", "m")
        assert len(handler.records) == before + 1
    finally:
        logger.removeHandler(handler)
        logger.propagate = True

    assert all(later - earlier >= interval_s for earlier, later in zip(logged_at, logged_at[1:]))
    counted = 0
    for line in handler.lines:
        summary = SUMMARY.match(line)
        counted += 1 + (int(summary.group(1)) if summary else 0)
        if summary:
            assert 1 <= int(summary.group(3)) <= min(int(summary.group(1)), 3)
    assert counted == len(flood) + 1
