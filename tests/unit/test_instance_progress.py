"""What an instance's heartbeat says of its query's progress (`pipeline.instance.QueryProgress`)."""

from __future__ import annotations

from pipeline.instance import QueryProgress


def test_a_query_progresses_when_it_completes_a_batch() -> None:
    progress = QueryProgress(progress_ms=1_000)
    progress.observe(now_ms=2_000, batch=0, in_trigger=True)
    assert progress.fields() == {"batch": 0, "progress_ms": 2_000}


def test_a_query_waiting_between_triggers_progresses_though_it_runs_no_batch() -> None:
    """Nothing to read (or a paced trigger not due): the query is not stuck, it has nothing to do."""
    progress = QueryProgress(progress_ms=1_000)
    progress.observe(now_ms=2_000, batch=0, in_trigger=True)
    progress.observe(now_ms=5_000, batch=0, in_trigger=False)
    assert progress.fields() == {"batch": 0, "progress_ms": 5_000}


def test_a_query_stuck_in_a_trigger_makes_no_progress() -> None:
    """A batch or a plan that never ends: the heartbeat goes on, its progress time does not."""
    progress = QueryProgress(progress_ms=1_000)
    progress.observe(now_ms=2_000, batch=4, in_trigger=True)
    for now_ms in range(3_000, 60_000, 500):
        progress.observe(now_ms=now_ms, batch=4, in_trigger=True)
    assert progress.fields() == {"batch": 4, "progress_ms": 2_000}


def test_before_its_first_batch_a_query_has_progressed_since_the_instance_started() -> None:
    progress = QueryProgress(progress_ms=1_000)
    progress.observe(now_ms=9_000, batch=-1, in_trigger=True)
    assert progress.fields() == {"batch": -1, "progress_ms": 1_000}
