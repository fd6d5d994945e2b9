"""The move-cost benchmark's arithmetic: a moved pid's pause, the yardstick, time to the target, CPU."""

from __future__ import annotations

from typing import Any

from bench.move_cost import (
    batch_interval_s,
    busy_per_s,
    p99_of_pids,
    pause_of,
    spell_figures,
    to_target_s,
)
from bench.run import ratio_to


def _batch(instance: str, at_s: float, reads: dict[int, int], duration_s: float = 0.5) -> dict[str, Any]:
    pids = {str(p): {"in": n, "state_bytes": 0, "window_tuples": 0} for p, n in reads.items()}
    return {"instance": instance, "time_ms": 1000 * at_s, "duration_s": duration_s, "pids": pids}


# pid 0 moves from a to b: a reads it every second up to 10 s, b from 12.5 s on; pid 1 stays on a.
RECORDS = [_batch("a", t, {0: 5, 1: 5}) for t in range(1, 11)]
RECORDS += [_batch("a", 11, {0: 0, 1: 5}), _batch("b", 12.5, {0: 9}), _batch("b", 13.5, {0: 5})]
RECORDS += [_batch("a", t, {1: 5}) for t in (12, 13, 14)]


def test_the_pause_is_the_longest_gap_between_batches_reading_the_pid_on_either_instance() -> None:
    assert pause_of(RECORDS, 0, after_ms=9_000) == 2.5  # 10 s on a -> 12.5 s on b
    assert pause_of(RECORDS, 1, after_ms=9_000) == 1.0


def test_the_yardstick_is_the_median_gap_of_every_pid_in_the_spell() -> None:
    assert batch_interval_s(RECORDS, 0, 10_500) == 1.0
    assert batch_interval_s(RECORDS, 20_000, 30_000) == 0.0  # nothing read: no yardstick


def test_time_to_target_counts_from_the_request_to_the_targets_first_batch_with_the_pid() -> None:
    assert to_target_s(RECORDS, 0, "b", after_ms=9_500) == 3.0
    assert to_target_s(RECORDS, 1, "b", after_ms=9_500) is None  # never moved


def test_busy_per_second_sums_batch_work_over_instances() -> None:
    assert busy_per_s(RECORDS, 12_000, 14_000) == 1.0  # four half-second batches in two seconds


def test_the_p99_of_unmoved_pids_leaves_the_moved_one_out() -> None:
    def batch(at_s: float, samples: dict[int, tuple[int, list[float]]]) -> dict[str, Any]:
        pids = {str(p): {"results": n, "latency_sample": s} for p, (n, s) in samples.items()}
        return {"time_ms": 1000 * at_s, "pids": pids}

    records = [batch(1, {0: (100, [50.0]), 1: (900, [1.0, 1.0])}), batch(2, {1: (90, [1.0]), 2: (0, [])})]
    assert p99_of_pids(records, 0, 3_000, moved=0) == 1.0
    assert p99_of_pids(records, 0, 3_000) == 50.0
    assert p99_of_pids(records, 1_500, 3_000, moved=1) is None, "no results of the others"


def test_a_step_is_compared_with_its_quiet_spell() -> None:
    assert ratio_to(1.2, 1.0) == 1.2
    assert ratio_to(None, 1.0) is None, "no results in the step's spell"
    assert ratio_to(1.0, None) is None and ratio_to(1.0, 0.0) is None, "no yardstick"


def test_a_quiet_spells_figures_are_those_of_every_pid() -> None:
    figures = spell_figures(RECORDS, 0, 10_500)
    assert figures["batch_interval_s"] == 1.0
    assert figures["busy_per_s"] == round(10 * 0.5 / 10.5, 3)
    assert figures["p99_s"] is None, "these batches carry no latency samples"
