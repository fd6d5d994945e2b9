"""How the instance's source caps a batch: whole pids, round robin, fewer tuples where recent batches made
many results per tuple (pure part of pipeline/source.py)."""

from __future__ import annotations

from pathlib import Path

from pipeline.source import (
    ArrivalMeter,
    read_results_per_tuple,
    tuples_within,
    whole_pids_within,
    write_results_per_tuple,
)


def offsets(**by_stream: dict[int, int]) -> dict[str, dict[str, int]]:
    return {s: {str(p): o for p, o in v.items()} for s, v in by_stream.items()}


START = offsets(A={0: 0, 1: 0, 2: 0}, B={0: 0, 1: 0, 2: 0})
LATEST = offsets(A={0: 10, 1: 2, 2: 30}, B={0: 1, 1: 20, 2: 30})


def test_a_pid_is_taken_whole_or_not_at_all() -> None:
    cut, next_pid = whole_pids_within(START, LATEST, cap=35, first_pid=0)
    assert cut == offsets(A={0: 10, 1: 2, 2: 0}, B={0: 1, 1: 20, 2: 0})  # 11 + 22 messages
    assert next_pid == 2


def test_the_next_batch_starts_where_the_last_stopped_and_wraps_round() -> None:
    cut, next_pid = whole_pids_within(START, LATEST, cap=35, first_pid=2)
    assert cut == offsets(A={0: 0, 1: 0, 2: 30}, B={0: 0, 1: 0, 2: 30})  # pid 2 alone is over the cap
    assert next_pid == 0


def test_every_pid_is_served_within_a_round() -> None:
    served: set[int] = set()
    start, first = START, 0
    for _ in range(3):
        cut, first = whole_pids_within(start, LATEST, cap=5, first_pid=first)
        served |= {int(p) for p in cut["A"] if cut["A"][p] == LATEST["A"][p]}
        start = cut
    assert served == {0, 1, 2}


def test_nothing_to_cut_without_pids() -> None:
    empty = offsets(A={}, B={})
    assert whole_pids_within(empty, empty, cap=5, first_pid=3) == (empty, 3)


def test_arrivals_are_measured_between_two_plans() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0, 1: 0}, B={0: 0, 1: 0}), now=10.0)
    assert meter.rate is None
    meter.observe(offsets(A={0: 30, 1: 10}, B={0: 20, 1: 20}), now=20.0)
    assert meter.rate == 8.0  # 80 messages in 10 s


def test_a_pid_seen_for_the_first_time_adds_no_arrivals() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0}, B={0: 0}), now=0.0)
    meter.observe(offsets(A={0: 10, 5: 1000}, B={0: 10, 5: 1000}), now=10.0)  # pid 5 just acquired
    assert meter.rate == 2.0


def test_an_instance_is_behind_when_more_waits_than_arrives_within_the_horizon() -> None:
    meter = ArrivalMeter()
    meter.observe(offsets(A={0: 0}, B={0: 0}), now=0.0)
    meter.observe(offsets(A={0: 50}, B={0: 50}), now=10.0)  # 10 messages a second
    assert not meter.behind(waiting=40, horizon_s=4.0)
    assert meter.behind(waiting=50, horizon_s=4.0)


def test_nobody_is_behind_before_arrivals_are_known() -> None:
    meter = ArrivalMeter()
    assert not meter.behind(waiting=123, horizon_s=1.0)


def test_a_batch_takes_fewer_tuples_where_each_makes_many_results() -> None:
    assert tuples_within(200_000, 4_000_000, None) == 200_000  # nothing known yet
    assert tuples_within(200_000, 4_000_000, 0.0) == 200_000  # recent batches made no results
    assert tuples_within(200_000, 4_000_000, 10.0) == 200_000
    assert tuples_within(200_000, 4_000_000, 40.0) == 100_000
    assert tuples_within(200_000, 1_000, 1e9) == 1  # always some input


def test_the_results_per_tuple_file_reads_back_what_the_sink_wrote(tmp_path: Path) -> None:
    path = tmp_path / "results_per_tuple.json"
    assert read_results_per_tuple(path) is None
    write_results_per_tuple(path, 27.5)
    write_results_per_tuple(path, 31.25)
    assert read_results_per_tuple(path) == 31.25
    assert [f.name for f in tmp_path.iterdir()] == [path.name]
