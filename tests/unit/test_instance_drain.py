"""When a stopping instance may stop (`pipeline.instance.Drain`, decision 0056): at once without a drain
timeout, otherwise once its assignment file holds nothing to hand over, or at the timeout."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.health import InstanceHealth, Phase
from pipeline.instance import Drain, holds_nothing
from pipeline.instance_files import OwnedPids, write_assignment
from pipeline.protocol import Mode, MoveSpec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drain(tmp_path: Path, timeout_s: float, owned: OwnedPids) -> tuple[Drain, threading.Event, Clock]:
    write_assignment(tmp_path / "assignment.json", owned)
    clock = Clock()
    health = InstanceHealth()
    health.enter(Phase.RUNNING)
    return Drain("i-0", timeout_s, tmp_path / "assignment.json", health, clock), threading.Event(), clock


MOVE = MoveSpec(move_id="m", pid=1, source="i-0", target="i-1", mode=Mode.TRANSFER)


@pytest.mark.parametrize(
    ("owned", "nothing"),
    [
        pytest.param(OwnedPids(epoch=3, pids=frozenset()), True, id="empty"),
        pytest.param(OwnedPids(epoch=3, pids=frozenset({1})), False, id="owns-a-pid"),
        pytest.param(OwnedPids(epoch=3, pids=frozenset(), releasing={1: MOVE}), False, id="releasing"),
        pytest.param(OwnedPids(epoch=3, pids=frozenset(), old_tracks={1: "m"}), False, id="old-track"),
    ],
)
def test_an_instance_holds_nothing_only_without_pids_releases_or_old_tracks(
    owned: OwnedPids, nothing: bool
) -> None:
    assert holds_nothing(owned) is nothing


def test_without_a_drain_timeout_a_stop_is_at_once(tmp_path: Path) -> None:
    drain, stopping, _ = _drain(tmp_path, 0, OwnedPids(epoch=1, pids=frozenset({1, 2})))
    assert not drain.may_stop(stopping)
    stopping.set()
    assert drain.may_stop(stopping)
    assert drain.health.phase is Phase.RUNNING


def test_a_draining_instance_stops_once_its_pids_have_moved(tmp_path: Path) -> None:
    drain, stopping, clock = _drain(tmp_path, 60, OwnedPids(epoch=1, pids=frozenset({1, 2})))
    stopping.set()
    assert not drain.may_stop(stopping)
    assert drain.health.phase is Phase.DRAINING
    write_assignment(drain.assignment, OwnedPids(epoch=2, pids=frozenset(), releasing={2: MOVE}))
    clock.now += 10
    assert not drain.may_stop(stopping)
    write_assignment(drain.assignment, OwnedPids(epoch=3, pids=frozenset()))
    assert drain.may_stop(stopping)


def test_a_draining_instance_stops_at_the_timeout_holding_pids(tmp_path: Path) -> None:
    drain, stopping, clock = _drain(tmp_path, 60, OwnedPids(epoch=1, pids=frozenset({1, 2})))
    stopping.set()
    assert not drain.may_stop(stopping)
    write_assignment(drain.assignment, OwnedPids(epoch=2, pids=frozenset({2}), releasing={2: MOVE}))
    clock.now += 59
    assert not drain.may_stop(stopping)
    clock.now += 1
    assert drain.may_stop(stopping)


def test_a_stopping_instance_that_nobody_drains_stops_after_20_s(tmp_path: Path) -> None:
    """No operator runs (or the pipeline is being deleted with its operator): waiting the whole drain
    timeout would only delay the stop (`helm uninstall` took 136 s instead of 7)."""
    drain, stopping, clock = _drain(tmp_path, 120, OwnedPids(epoch=4, pids=frozenset({1, 2})))
    stopping.set()
    assert not drain.may_stop(stopping)
    clock.now += 19
    assert not drain.may_stop(stopping)
    clock.now += 1
    assert drain.may_stop(stopping)
