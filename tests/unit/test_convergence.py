"""The convergence benchmark's arithmetic: imbalance per bucket and when the moves settled; the rounds
it reads from the controller's decisions file, and flux's own verdict that the instances are balanced."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.convergence import Round, convergence_of, imbalance_series, rounds_of
from controller.assignment import Assignment
from controller.policies import Decision, FluxParams, FluxPolicy, InstanceStats, PidStats, Snapshot
from controller.runner import append_decision


def _batch(instance: str, at_s: float, duration_s: float, period_s: float = 5.0) -> dict[str, object]:
    return {
        "kind": "batch",
        "instance": instance,
        "time_ms": 1000 * at_s,
        "duration_s": duration_s,
        "busy": duration_s / period_s,
    }


def test_imbalance_is_busiest_over_idlest_per_bucket() -> None:
    records = [
        _batch("a", 1, 4.0), _batch("b", 2, 1.0),  # bucket 0: 0.8 / 0.2
        _batch("a", 6, 2.0), _batch("b", 7, 2.0),  # bucket 1: balanced
        _batch("a", 16, 1.0),                      # bucket 2 empty: as before; bucket 3: b still at 0.4
        {"kind": "heartbeat", "instance": "b", "time_ms": 17_000},
    ]  # fmt: skip
    assert imbalance_series(records, ["a", "b"], start_ms=0) == [4.0, 1.0, 1.0, 2.0]


def test_an_instance_before_its_first_batch_reads_idle() -> None:
    assert imbalance_series([_batch("a", 1, 2.5)], ["a", "b"], start_ms=0) == [50.0]


def _flux_round(sites: dict[str, tuple[float, list[int]]]) -> Decision:
    """Flux's round (default thresholds) over {instance: (U, [N_pid of each pid it owns])}."""
    owned = [(site, tuples) for site, (_, pids) in sites.items() for tuples in pids]
    snapshot = Snapshot(
        now_s=100.0,
        instances=tuple(InstanceStats(site, u, 0) for site, (u, _) in sites.items()),
        pids={pid: PidStats(pid, tuples, 0, 0) for pid, (_, tuples) in enumerate(owned)},
        assignment=Assignment(1, {pid: site for pid, (site, _) in enumerate(owned)}),
        interval_s=1.0,
    )
    return FluxPolicy().decide(snapshot, FluxParams())


def test_flux_is_balanced_when_the_most_and_the_least_utilized_are_within_th_imb() -> None:
    balanced = _flux_round({"a": (0.50, [50]), "b": (0.46, [46]), "c": (0.44, [44])})
    assert balanced.balanced and not balanced.moves
    moving = _flux_round({"a": (0.8, [40, 40]), "b": (0.2, [20])})
    assert moving.moves and not moving.balanced
    stuck = _flux_round({"a": (0.8, [80]), "b": (0.2, [20])})  # unbalanced, but no move reduces it
    assert not stuck.moves and not stuck.balanced
    busy = _flux_round({"a": (0.95, [95]), "b": (0.92, [92])})  # the least utilized is busy too
    assert not busy.moves and not busy.balanced


def test_rounds_are_read_from_the_controllers_decisions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "decisions.jsonl"
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    for at, sites in (
        (1000.0, {"a": (0.8, [40, 40]), "b": (0.2, [20])}),
        (1010.0, {"a": (0.95, [95]), "b": (0.92, [92])}),
        (1020.0, {"a": (0.50, [50]), "b": (0.46, [46])}),
    ):
        now[0] = at
        append_decision(path, "flux", _flux_round(sites))
    first = json.loads(path.read_text().splitlines()[0])
    assert first["time"] == 1000.0 and first["policy"] == "flux" and not first["balanced"]
    assert first["moves"] == [[0, "a", "b"]] and first["reason"].startswith("flux: a->b: move pid 0")
    assert rounds_of(path, start=999.5) == [
        Round(0.5, 1, False),
        Round(10.5, 0, False),
        Round(20.5, 0, True),
    ]


def _round(at_s: float, moves: int = 0, balanced: bool = False) -> Round:
    return Round(at_s, moves, balanced)


def test_balanced_at_the_first_balanced_round_after_the_shifts_last_moves() -> None:
    rounds = [
        _round(10, 2), _round(30, balanced=True),
        _round(65, 3),
        _round(70, balanced=True),  # between moves: the load it saw may not yet be the shift's
        _round(75, 1), _round(80), _round(90, balanced=True), _round(95),
    ]  # fmt: skip
    assert convergence_of(rounds, shift_s=60, end_s=120) == {
        "moves": 6,
        "moves_per_min": 3.0,
        "rounds_after_shift": 2,
        "rounds_to_balance": 2,
        "balanced_s": 30.0,
        "settle_s": 15.0,
    }


def test_a_run_still_moving_or_left_unbalanced_is_not_balanced() -> None:
    moving = convergence_of([_round(61, 2), _round(90, balanced=True), _round(105, 1)], 60, 120)
    assert moving["rounds_to_balance"] is None and moving["balanced_s"] is None
    assert moving["settle_s"] is None  # a move 15 s before the end
    late = convergence_of([_round(61, 2), _round(95, 1), _round(105, balanced=True)], 60, 120)
    assert late["balanced_s"] is None and late["settle_s"] == 35.0  # balanced for 15 s only
    unbalanced = convergence_of([_round(61, 2), _round(70, 1), _round(80)], shift_s=60, end_s=120)
    assert unbalanced["balanced_s"] is None and unbalanced["settle_s"] == 10.0
    quiet = convergence_of([_round(10, 1), _round(70, balanced=True)], shift_s=60, end_s=120)
    assert quiet["rounds_to_balance"] == 0 and quiet["balanced_s"] == 0.0 and quiet["settle_s"] == 0.0
