"""The convergence benchmark's arithmetic: imbalance per bucket and when the moves settled."""

from __future__ import annotations

import time

from controller.bench import Round, convergence_of, imbalance_series, rounds_of


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


def test_rounds_are_read_from_the_controller_log() -> None:
    start = time.mktime((2026, 11, 25, 14, 0, 0, 0, 0, -1)) + 0.5
    log = [
        "14:00:00 epoch 0: 64 pids over 4 instances",
        "14:00:10 policy flux: pid 3 instance-0 -> instance-1 (flux: instance-0->instance-1: move pid 3 (U))",
        "14:00:10 policy flux: pid 4 instance-0 -> instance-1 (flux: instance-0->instance-1: move pid 3 (U))",
        "14:00:11 move m-1: pid 3 instance-0 -> instance-1 (parallel_track) started",
        "14:00:20 policy flux: pid 9 instance-0 -> instance-2 (flux: instance-0->instance-2: move pid 9)",
        "14:00:30 policy flux: no move (flux: instance-0->instance-3: no pid reduces the imbalance)",
        "14:00:35 policy flux: no move (flux: stopped at instance-2->instance-1: U_r 2.284 > th_util 0.9)",
        "14:00:40 policy flux: no move (flux: stopped at instance-0->instance-3: U_d/U_r 1.1 < th_imb 1.2)",
    ]
    assert rounds_of(log, start) == [
        Round(9.5, 2, False),
        Round(19.5, 1, False),
        Round(29.5, 0, False),
        Round(34.5, 0, False),  # the least utilized is busy too: not balanced
        Round(39.5, 0, True),
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
