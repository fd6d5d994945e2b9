"""The convergence benchmark's arithmetic: imbalance per bucket and when the moves settled."""

from __future__ import annotations

from controller.bench import convergence_of, imbalance_series


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


def test_moves_that_stop_have_settled_and_moves_until_the_end_have_not() -> None:
    settled = convergence_of([10.0, 61.0, 61.5, 70.0], shift_s=60, end_s=120)
    assert settled == {"moves": 4, "moves_per_min": 2.0, "rounds_after_shift": 2, "settle_s": 10.0}
    thrashing = convergence_of([61.0, 80.0, 110.0], shift_s=60, end_s=120)
    assert thrashing["settle_s"] is None and thrashing["rounds_after_shift"] == 3
    assert convergence_of([], shift_s=60, end_s=120)["settle_s"] == 0.0
