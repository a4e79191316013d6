"""The coordinator's health checks (coordinator/monitor.py): a service that answers one check late on a busy
host stays up; one that stops answering, or refuses, goes down."""

from __future__ import annotations

import time

import pytest

from coordinator import links
from coordinator.monitor import CHECK_TIMEOUT, SLOW_CHECKS, Monitor
from tandem.config import CoordinatorSettings

LATE = "DEADLINE_EXCEEDED: Deadline Exceeded"
GONE = "UNAVAILABLE: failed to connect to all addresses"


@pytest.fixture
def monitor(monkeypatch):
    monitor = Monitor(CoordinatorSettings(target_addr="127.0.0.1:9"))
    monkeypatch.setattr(monitor, "_publish", lambda: None)
    monkeypatch.setattr(links, "last_answer", {})  # no step answered yet
    monkeypatch.setattr("coordinator.monitor.last_answer", links.last_answer)
    monitor.target.up = True
    yield monitor
    monitor.target.channel.close()


def check(monitor: Monitor, monkeypatch, answer: str | None) -> bool:
    monkeypatch.setattr(monitor.target, "problem", lambda: answer)
    monitor._check(monitor.target)
    return monitor.target.up


def test_a_late_answer_now_and_then_keeps_the_service_up(monitor, monkeypatch):
    """A check that times out is re-checked at once; a service down only after SLOW_CHECKS of them in a row
    (at 16 concurrent requests beside vLLM's engine one 1-s check had failed every request in flight)."""
    for _ in range(3):
        assert all(check(monitor, monkeypatch, LATE) for _ in range(SLOW_CHECKS - 1))
        assert monitor.target.next_check <= time.monotonic()  # checked again at once
        assert check(monitor, monkeypatch, None)  # it answered: the count starts over
    assert all(check(monitor, monkeypatch, LATE) for _ in range(SLOW_CHECKS - 1))
    assert not check(monitor, monkeypatch, LATE)
    assert monitor.target.reason == LATE


def test_a_service_whose_steps_come_back_stays_up_however_late_its_checks(monitor, monkeypatch):
    """Late checks while the service answers generations' steps: busy, not hung (beside vLLM's engines and a
    compile the target missed three checks and every request in flight failed). Once its steps stop coming
    back too, the next late check takes it down."""
    for _ in range(3 * SLOW_CHECKS):
        links.last_answer["target"] = time.monotonic()  # a step came back
        assert check(monitor, monkeypatch, LATE)
    assert monitor.target.busy
    links.last_answer["target"] = time.monotonic() - SLOW_CHECKS * CHECK_TIMEOUT - 0.1  # none since
    assert not check(monitor, monkeypatch, LATE) and monitor.target.reason == LATE
    monitor.target.up = True
    links.last_answer["target"] = time.monotonic()
    assert not check(monitor, monkeypatch, GONE)  # a refusal is not lateness: down at once, steps or not


def test_a_service_that_refuses_goes_down_at_once(monitor, monkeypatch):
    assert check(monitor, monkeypatch, LATE)
    assert not check(monitor, monkeypatch, GONE) and monitor.target.reason == GONE
    monitor.target.up = True
    assert not check(monitor, monkeypatch, "health NOT_SERVING")  # draining


def test_a_new_generation_waits_a_little_for_a_target_down_for_late_checks(monitor, monkeypatch):
    """Down for late checks (a loaded host), the target is waited for up to the patience; down for a refusal,
    or not back in time, UNAVAILABLE at once or at the patience's end."""
    import threading

    from tandem.errors import Abort

    monitor._current = "the pair"
    monkeypatch.setattr(monitor, "_on_target", lambda up: None)
    for _ in range(SLOW_CHECKS):
        check(monitor, monkeypatch, LATE)
    assert not monitor.target.up
    threading.Timer(0.2, monitor._up, [monitor.target]).start()
    started = time.monotonic()
    assert monitor.pair(patience=5.0) == "the pair" and 0.15 < time.monotonic() - started < 2.0
    monitor._down(monitor.target, LATE)
    started = time.monotonic()
    with pytest.raises(Abort, match="unavailable"):
        monitor.pair(patience=0.3)
    assert 0.25 < time.monotonic() - started < 2.0
    monitor._down(monitor.target, GONE)
    started = time.monotonic()
    with pytest.raises(Abort, match="unavailable"):
        monitor.pair(patience=5.0)  # a refusal: no wait
    assert time.monotonic() - started < 0.2

