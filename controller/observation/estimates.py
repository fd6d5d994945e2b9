"""Estimators over one instance's batch records: how busy it is, its fixed cost per batch, a tuple's
cost, and its demand from its own progress.

Each is a pure function of the records the observer keeps (`controller.observation.observer`), apart
from the snapshot that combines them (`controller.observation.snapshot`), so that each rule is stated
and tested on its own (docs/load-model.md, "Busy fraction and fixed cost"; "Warm-up"; "Demand and progress").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def busy_fraction(batches: Sequence[dict[str, Any]]) -> float:
    """The share of the time these batches cover that the instance spent inside them.

    A batch record's period runs from the end of the instance's previous batch to its own end (its
    `busy` is duration / period), so durations over periods measure utilization whatever the
    collection interval. A plain sum of durations over a window shorter than a batch reads 0 or more
    than 1 depending on whether a batch happened to end inside it, and micro-batches of a loaded
    instance last seconds.
    """
    period = period_s(batches)
    return min(1.0, sum(b["duration_s"] for b in batches) / period) if period > 0 else 0.0


def period_s(batches: Sequence[dict[str, Any]]) -> float:
    """Seconds these batches cover: the sum of their periods (duration / busy)."""
    return sum(b["duration_s"] / b["busy"] for b in batches if b["busy"] > 0)


MIN_FIT_BATCHES = 5
"""Fewest batches a fixed-cost estimate is fitted on; with fewer, the shortest batch that read nothing
stands in."""


def shortest_empty_s(batches: Sequence[dict[str, Any]]) -> float | None:
    """The shortest of these batches that read nothing (not a query's first, batch 0, which pays for
    Spark starting); None if there is none."""
    return min(
        (float(b["duration_s"]) for b in batches if b["tuples_in"] == 0 and b.get("batch") != 0), default=None
    )


def fixed_cost_s(batches: Sequence[dict[str, Any]], empty_s: float | None = None) -> float:
    """Seconds one of the instance's batches costs whatever its input: the intercept of a least-squares
    line of batch duration against tuples read, kept within [0, the shortest batch] (a line that says
    more input costs less is noise, and no batch costs less than its fixed part), and no longer than
    the shortest batch that read nothing, among these and `empty_s` (the instance's shortest such
    batch so far, kept beyond the history at hand). A batch that read nothing is the fixed cost
    measured directly; in a steady spell every batch reads about as many tuples, and the line's
    intercept is poorly determined, well above what the empty batches took (docs/load-model.md, "Busy
    fraction and fixed cost").

    Before MIN_FIT_BATCHES batches, or with tuple counts all alike, it is the shortest batch that read
    nothing (an instance's second batch, before its input starts, or a release), no longer than the
    shortest batch, else 0, unknown. A round early in the input would otherwise charge a near-idle
    instance's whole batch time to its few tuples, read it as nearly busy, and refuse it a hot pid
    (docs/load-model.md, "Warm-up")."""
    durations = [float(b["duration_s"]) for b in batches]
    known = [s for s in (empty_s, shortest_empty_s(batches)) if s is not None]
    shortest = min(durations, default=0.0)
    idle = min(min(known), shortest) if known else 0.0
    if len(batches) < MIN_FIT_BATCHES:
        return idle
    try:
        _, intercept = statistics.linear_regression([float(b["tuples_in"]) for b in batches], durations)
    except statistics.StatisticsError:
        return idle
    fitted = min(max(intercept, 0.0), shortest)
    return min(fitted, idle) if known else fitted


def split_busy(described: Sequence[dict[str, Any]], fixed_s: float) -> tuple[float, float]:
    """(busy_fraction(described), the part of it that is fixed per-batch cost, `fixed_s` a batch)."""
    busy = busy_fraction(described)
    period = period_s(described)
    fixed = fixed_s * len(described) / period if period > 0 else 0.0
    return busy, min(busy, fixed)


def described_by(history: Sequence[dict[str, Any]], since_ms: float) -> list[dict[str, Any]]:
    """The batches of one instance's `history` (oldest first) that ended at or after `since_ms`, else
    its latest batch: an instance with none ending in the interval is inside a longer batch (a loaded
    instance), and reading it as idle would send it more work. Empty before its first batch."""
    return [b for b in history if b["time_ms"] >= since_ms] or list(history[-1:])


def cost_per_tuple_s(described: Sequence[dict[str, Any]], fixed_s: float) -> float | None:
    """Seconds a tuple costs the instance: the time its described batches that read input took beyond
    their fixed cost, over the tuples they read; None if they read none. A batch that read nothing
    says nothing of a tuple's cost: early in the input, an instance's warm-up batch (Spark starting)
    counted as per-tuple time made a near-idle instance's tuples read many times dearer than they were
    (docs/load-model.md, "A tuple's cost")."""
    priced = [b for b in described if b["tuples_in"] > 0]
    if not priced:
        return None
    work = sum(b["duration_s"] for b in priced) - fixed_s * len(priced)
    return max(work, 0.0) / sum(b["tuples_in"] for b in priced)


PROGRESS_BATCHES = 2
"""Newest batches `demand_from_progress` measures over: one slow batch alone reads as an overload."""


def demand_from_progress(history: Sequence[dict[str, Any]], owns: set[int]) -> float | None:
    """Seconds of work per second of input, from the instance's own progress: the newest
    PROGRESS_BATCHES batches' durations over the event time their input advanced (the newest event
    time they read, against their predecessors'). None if no batch qualifies.

    A micro-batch reads what arrived while the one before it ran, so an instance that keeps up
    advances a trigger's worth of input per batch (the ratio is its busy fraction), one that is behind
    advances as much input as its previous batch took time (the ratio is the growth of its batches,
    above 1), and one catching up advances more than it takes (below 1). It needs no cost model: a
    donor left with five hot pids read a modelled demand below 1 while its batches grew
    (docs/load-model.md, "Demand and progress").

    A batch counts only when it read nothing its predecessor did not (not a receiver's first batch
    of a pid, which reads a backlog) and only pids the instance owns (`owns`; not a release, nor a
    parallel track's tail, whose pids have left its demand already)."""

    def newest_read(batch: dict[str, Any]) -> dict[str, int]:
        return {
            p: s["newest_ms"] for p, s in batch["pids"].items() if s["in"] > 0 and s.get("newest_ms", 0) > 0
        }

    work = advanced_s = 0.0
    counted = 0
    for b, before in reversed(list(zip(history[1:], history[:-1], strict=True))):
        read, earlier = newest_read(b), newest_read(before)
        if not read or any(p not in earlier or int(p) not in owns for p in read):
            continue
        span_ms = max(read.values()) - max(earlier[p] for p in read)
        if span_ms <= 0:
            continue
        work += b["duration_s"]
        advanced_s += span_ms / 1000
        counted += 1
        if counted == PROGRESS_BATCHES:
            break
    return work / advanced_s if advanced_s > 0 else None


def first_of_new_input(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches of an instance's `history` (oldest first) that read input after one that read none:
    the first batch of new input pays for compiling the join, and its cost per tuple on a near-idle
    instance is several times a later batch's (docs/load-model.md, "A tuple's cost")."""
    return [
        b for k, b in enumerate(history) if k > 0 and b["tuples_in"] > 0 and history[k - 1]["tuples_in"] == 0
    ]
