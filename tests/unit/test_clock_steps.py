"""What a step of an instance's wall clock does to the controller's judgement and to the instance's own
progress report: nothing (decision 0054). The end-to-end test is `tests/integration/test_clock.py`."""

from __future__ import annotations

from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, TIMESTAMP_NOT_AVAILABLE

from controller.observation.liveness import query_stalled_s
from controller.observation.observer import appended_ms
from pipeline.instance import QueryProgress

HOUR_MS = 3_600_000


def test_a_record_is_aged_by_the_brokers_clock_when_the_topic_has_it() -> None:
    assert appended_ms((TIMESTAMP_LOG_APPEND_TIME, 1_700_000_000_000)) == 1_700_000_000_000


def test_a_topic_stamped_by_its_producers_leaves_the_records_own_time() -> None:
    """A metrics topic created before the broker stamped it: the instance's clock, as before."""
    assert appended_ms((TIMESTAMP_CREATE_TIME, 1_700_000_000_000)) is None
    assert appended_ms((TIMESTAMP_NOT_AVAILABLE, -1)) is None


def test_a_stall_is_what_the_instance_timed_on_its_monotonic_clock() -> None:
    """An hour's step of the instance's wall clock between its progress and its heartbeat changes
    nothing: the heartbeat says how long ago the query progressed."""
    beat = {"kind": "heartbeat", "time_ms": 5 * HOUR_MS, "progress_ms": 4 * HOUR_MS, "stalled_ms": 400}
    assert query_stalled_s(beat) == 0.4


def test_a_heartbeat_without_a_stall_is_judged_by_its_own_two_times_as_before() -> None:
    beat = {"kind": "heartbeat", "time_ms": 200_000, "progress_ms": 50_000}
    assert query_stalled_s(beat) == 150.0
    assert query_stalled_s({**beat, "progress_ms": 300_000}) == 0.0, "a step back is no stall"
    assert query_stalled_s({"kind": "heartbeat", "time_ms": 1}) is None, "no progress reported"
    assert query_stalled_s({"kind": "batch", "time_ms": 1, "stalled_ms": 9}) is None


def test_progress_never_goes_back_when_the_wall_clock_steps_back() -> None:
    """Stepped back an hour, the query still progresses: its progress time counts on, so that whoever
    times progress from its change (the health probe, the heartbeat) sees each progress."""
    progress = QueryProgress(progress_ms=10 * HOUR_MS)
    progress.observe(now_ms=10 * HOUR_MS + 500, batch=0, in_trigger=False)
    said = [progress.progress_ms]
    for step in range(4):  # the clock is an hour behind now
        progress.observe(now_ms=9 * HOUR_MS + 500 * step, batch=step + 1, in_trigger=True)
        said.append(progress.progress_ms)
    assert said == sorted(set(said)), f"each progress moves it on: {said}"
    progress.observe(now_ms=12 * HOUR_MS, batch=5, in_trigger=False)
    assert progress.progress_ms == 12 * HOUR_MS, "once the clock is past it, the clock again"
