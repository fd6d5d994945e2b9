"""A committed batch's metrics record (the `batch` records of the metrics topic, docs/architecture.md),
built from the batch's columns.

Pure: the sink (`pipeline.sink`) reads the clocks, keeps what outlives a batch (the previous batch's
end, each pid's window bytes) and produces the record in the batch's transaction; what the record
says is worked out here from what it is given, so it is tested as a function, without Kafka or Spark.
What the record needs beyond counting (each result's event time, decoded from the results messages,
and the input's lag, asked of the broker) is worked out before the transaction begins
(`BeforeCommit`): the broker bounds a transaction's length.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import numpy as np

from pipeline.codec import decode_results
from pipeline.operator import KIND_CLEANED, KIND_RESULT, KIND_STATS, decode_stats_payload
from pipeline.spill import cleanups_of, deferred, spilled_of

PidFigures = TypedDict(
    "PidFigures",
    {
        "in": int,  # input tuples the batch read of the pid
        "results": int,
        "within": int,  # combinations of the batch's own tuples of the pid that share a key
        "state_bytes": int,  # the pid's window after the batch
        "window_tuples": int,
        "newest_ms": int,  # the newest event time read
        "latency_sample": list[float],
        "hot_key": tuple[int, int] | None,  # (key, results) of its hottest key, when it stands out
    },
)
"""One pid's figures in a batch's metrics record (`BatchRecord.pids`)."""


class BatchRecord(TypedDict):
    """A committed batch's record on the metrics topic (`kind` "batch"), as JSON with these keys. The
    controller's observer, `fluxjoin status`, the instance's /metrics and the benchmarks read it."""

    kind: Literal["batch"]
    instance: str
    batch: int
    epoch: int
    time_ms: int  # wall clock at the commit
    duration_s: float
    busy: float  # the batch's share of the time since the previous batch ended
    tuples_in: int
    results: int
    late: int
    malformed: int
    latency_p50_s: float | None
    latency_p99_s: float | None
    latency_sample: list[float]  # evenly spaced over the batch's sorted latencies
    pids: dict[str, PidFigures]
    state_bytes: int  # every kept pid's window, idle ones included
    state_budget_bytes: int
    lag: dict[str, int]  # per pid: input messages beyond the batch's end
    spilled: dict[str, int]  # per pid whose old generation is out of memory after the batch: its bytes
    deferred: list[str]  # the spilled pids with results left for their clean-up (the others are parked)
    cleaned: dict[str, tuple[int, int]]  # per pid cleaned up in the batch: (tuples re-read, results made)


def held_after(
    held: Mapping[int, int], batch: Mapping[str, Mapping[str, Any]], kept: Container[str]
) -> dict[int, int]:
    """Each pid's window bytes after a batch: the batch's pids at their new sizes, the others at their
    newest batch's (an idle pid holds its window still), pids the batch's offsets no longer keep (moved
    away) or whose windows are empty left out."""
    sizes = {**held, **{int(p): int(stats["state_bytes"]) for p, stats in batch.items()}}
    return {p: size for p, size in sizes.items() if size and str(p) in kept}


@dataclass(frozen=True, slots=True)
class BeforeCommit:
    """What a batch's metrics need that is worked out before its transaction begins: decoding every
    results message and asking the broker for the input's end offsets would lengthen a transaction
    the broker aborts after `pipeline.sink.TRANSACTION_TIMEOUT_S`."""

    result_times_ms: np.ndarray  # each result's newest event time
    result_pids: np.ndarray  # each result's pid
    lag: dict[str, int]


def _sample(values: np.ndarray, n: int) -> list[float]:
    """`n` evenly spaced values of `values` sorted: readers take percentiles over many batches from
    them, each value standing for `len(values) / n`."""
    if not len(values):
        return []
    ordered = np.sort(values)
    picks = ordered[np.linspace(0, len(ordered) - 1, min(n, len(ordered))).astype(int)]
    return [round(float(v), 4) for v in picks]


def _by_pid(pids: np.ndarray, values: np.ndarray) -> dict[int, np.ndarray]:
    """`values` split by the pid of each."""
    if not len(pids):
        return {}
    order = np.argsort(pids, kind="stable")
    found, starts = np.unique(pids[order], return_index=True)
    return {int(p): part for p, part in zip(found, np.split(values[order], starts[1:]), strict=True)}


def result_times(columns: Mapping[str, np.ndarray], kind: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each result's newest event time (ms) and its pid, decoded from the results messages."""
    rows = kind == KIND_RESULT
    if not rows.any():
        return np.empty(0), np.empty(0, dtype=np.int64)
    times = [decode_results(payload).max_event_times for payload in columns["payload"][rows]]
    return np.concatenate(times).astype(np.float64), np.repeat(columns["pid"][rows], columns["key"][rows])


def batch_record(
    instance: str,
    batch_id: int,
    offsets: Mapping[str, Any],
    columns: Mapping[str, np.ndarray],
    kind: np.ndarray,
    results: int,
    late: int,
    malformed: int,
    ready: BeforeCommit,
    *,
    now: float,
    started: float,
    ended: float,
    last_end: float,
    held: Mapping[int, int],
    kept: Container[str],
    state_budget_bytes: int,
) -> tuple[BatchRecord, dict[int, int]]:
    """Per-batch metrics (latency measured at `now`, wall-clock s, just before commit), and each kept
    pid's window bytes after the batch (`held_after` of `held`, the pids the batch's offsets keep).

    `started`, `ended` and `last_end` (the previous batch's end) are monotonic s: the batch ran from
    `started` to `ended`, and was busy for that share of the time since `last_end`."""
    latency, by_pid = np.empty(0), {}

    def ends_of(p: int) -> dict[str, int]:
        """Where the batch's input of pid `p` ended, per stream: where the next batch begins."""
        return {s: int(ends[str(p)]) for s, ends in offsets["offsets"].items() if str(p) in ends}

    if results:
        latency = now - ready.result_times_ms / 1000.0
        by_pid = _by_pid(ready.result_pids, latency)
    stats = kind == KIND_STATS
    busy = (ended - started) / max(ended - last_end, 1e-3)
    pids: dict[str, PidFigures] = {
        str(p): {
            "in": int(n),
            "results": int(r),
            "state_bytes": int(b),
            "window_tuples": int(w),
            "newest_ms": int(t),
            "latency_sample": _sample(by_pid.get(int(p), np.empty(0)), 20),
            "within": within,
            "hot_key": hot,
        }
        for p, n, r, b, w, t, (within, hot) in zip(
            columns["pid"][stats],
            columns["id0"][stats],
            columns["id1"][stats],
            columns["aux"][stats],
            columns["key"][stats],
            columns["ts"][stats],
            map(decode_stats_payload, columns["payload"][stats]),
            strict=True,
        )
    }
    held_now = held_after(held, pids, kept)
    cleaned = kind == KIND_CLEANED
    made = {
        int(p): (int(n), int(r))
        for p, n, r in zip(
            columns["pid"][cleaned], columns["key"][cleaned], columns["aux"][cleaned], strict=True
        )
    }
    spilled = spilled_of(offsets)
    record: BatchRecord = {
        "kind": "batch",
        "instance": instance,
        "batch": batch_id,
        "epoch": int(offsets["epoch"]),
        "time_ms": int(now * 1000),
        "duration_s": ended - started,
        "busy": min(1.0, busy),
        "tuples_in": int(columns["id0"][stats].sum()) if stats.any() else 0,
        "results": results,
        "late": late,
        "malformed": malformed,
        "latency_p50_s": float(np.percentile(latency, 50)) if len(latency) else None,
        "latency_p99_s": float(np.percentile(latency, 99)) if len(latency) else None,
        # An evenly spaced sample of this batch's sorted latencies, for run-wide percentiles.
        "latency_sample": _sample(latency, 200),
        "pids": pids,
        "state_bytes": sum(held_now.values()),
        "state_budget_bytes": state_budget_bytes,
        "lag": ready.lag,
        "spilled": {str(p): spill.state_bytes for p, spill in sorted(spilled.items())},
        "deferred": sorted(str(p) for p, spill in spilled.items() if deferred(spill, ends_of(p))),
        # clean-ups planned here, and recoveries of a dead owner's spilled pids (`Handoff.spilled`)
        "cleaned": {str(p): made.get(p, (0, 0)) for p in sorted({*cleanups_of(offsets), *made})},
    }
    return record, held_now
