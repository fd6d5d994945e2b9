"""Where a batch's time went (pipeline/batch_timings.py): the log the instance appends and the breakdown
the latency benchmark reports."""

from __future__ import annotations

from pathlib import Path

from pipeline.batch_timings import BatchTimingsLog, breakdown, read_batch_timings, slowest_breakdown


def progress(batch: int, total_ms: int, **phases_ms: int) -> dict:
    return {
        "batchId": batch,
        "timestamp": "2026-11-29T13:00:00.000Z",
        "numInputRows": 10,
        "durationMs": {"triggerExecution": total_ms, **phases_ms},
    }


SINK = {"collect": 0.5, "prepare": 0.1, "produce": 0.1, "commit": 0.05, "notes": 0.05}


def test_a_batch_is_written_once_when_both_spark_and_the_sink_have_it(tmp_path: Path) -> None:
    log = BatchTimingsLog(tmp_path / "batch_timings.jsonl")
    log.observe([progress(0, 1000), progress(1, 900)], {0: SINK})  # the sink has not finished batch 1
    log.observe([progress(0, 1000), progress(1, 900), progress(2, 800)], {0: SINK, 1: SINK, 2: SINK})
    assert [row["batch"] for row in read_batch_timings(log.path)] == [0, 1, 2]


def test_the_phases_add_up_to_the_batch_and_the_rest_is_named_other() -> None:
    row = {"spark_ms": {"triggerExecution": 1000, "latestOffset": 100, "walCommit": 50}, "sink_s": SINK}
    parts = breakdown(row)
    assert parts["total"] == 1.0
    assert round(parts["other"], 3) == 0.05  # 1.0 - 0.15 (Spark) - 0.8 (sink)
    assert round(sum(v for k, v in parts.items() if k != "total"), 6) == 1.0


def test_the_slowest_share_is_at_least_one_batch() -> None:
    rows = [{"spark_ms": {"triggerExecution": ms}, "sink_s": SINK} for ms in (900, 1000, 5000)]
    assert slowest_breakdown(rows)["total"] == 5.0
    assert slowest_breakdown(rows, share=0.5)["total"] == 3.0  # the two slowest
    assert slowest_breakdown([]) == {}


def test_nothing_is_read_before_anything_was_written(tmp_path: Path) -> None:
    assert read_batch_timings(tmp_path / "none.jsonl") == []
