"""The loaded-machines benchmark's arithmetic: its phases, the throughput per bucket, and when a
pipeline counts as recovered from a slowdown."""

from __future__ import annotations

from bench.loaded import BUCKET_S, Phase, mean_over, phases_of, recovery_s, throughput_series


def test_phases_slow_one_then_k_then_none() -> None:
    phases = phases_of(["i0", "i1", "i2", "i3"], 3, calm_s=30, slow_s=60)
    assert phases == [
        Phase("calm", 0.0, ()),
        Phase("one_slowed", 30.0, ("i0",)),
        Phase("3_slowed", 90.0, ("i0", "i1", "i2")),
        Phase("restored", 150.0, ()),
    ]


def test_throughput_counts_tuples_by_the_bucket_their_batch_ended_in() -> None:
    start = 1_000_000.0
    records = [
        {"kind": "batch", "time_ms": start + 1000, "tuples_in": 500},
        {"kind": "batch", "time_ms": start + 4000, "tuples_in": 500},
        {"kind": "batch", "time_ms": start + 11_000, "tuples_in": 2000},
        {"kind": "heartbeat", "time_ms": start + 2000},
        {"kind": "batch", "time_ms": start - 1000, "tuples_in": 9999},  # before the input started
    ]
    assert throughput_series(records, start) == [1000 / BUCKET_S, 0.0, 2000 / BUCKET_S]


def test_recovery_is_the_time_to_the_last_bucket_behind() -> None:
    rate = 100.0
    series = [100, 100, 40, 50, 95, 120, 100, 100]  # buckets of 5 s
    assert recovery_s(series, rate, from_s=10, to_s=40) == 10.0, "behind in [10, 20), keeping up after"
    assert recovery_s(series, rate, from_s=0, to_s=10) == 0.0, "never behind"
    assert recovery_s([100, 40, 40], rate, from_s=0, to_s=15) is None, "still behind at the phase's end"
    assert recovery_s([100], rate, from_s=0, to_s=15) is None, "the run ended before the phase did"


def test_mean_over_whole_buckets() -> None:
    assert mean_over([10, 20, 30, 40], 5, 20) == 30.0
    assert mean_over([10], 5, 20) is None
