"""Arrival rates of the pids, and whether an instance's input has just begun.

A pid's rate is measured by event time from the batch records of whichever instances read it, and
from what batches still in flight have read (their read reports); an instance whose input has just
begun is not measured yet. Apart from the estimators of an instance's costs
(`controller.observation.estimates`): these say how much input there is, not what it costs
(docs/load-model.md, "Arrival rates"; "The load of a batch in flight"; "Warm-up").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

RATE_SPAN_S = 10.0
"""Least event time a pid's arrival rate is measured over: its newest records that cover this much."""


def arrival_rates(
    history: Mapping[str, Sequence[dict[str, Any]]], described: Mapping[str, Sequence[dict[str, Any]]]
) -> dict[int, float]:
    """Tuples per second arriving for each pid now, from the newest batches that read its tuples.

    A batch record carries, per pid, the tuples it read and the newest event time among them. Ordered
    by that time, whichever instance read them (a moved pid's records come from its old and new
    owners), a run of records ending at the newest holds the tuples that arrived since the record
    before it, over the event time between the two. The figure does not depend on how far behind a
    reader is: a receiver's first batch of a moved pid reads the backlog since the cutoff, and its
    event time spans that whole backlog.

    The run is the newest records that cover RATE_SPAN_S, within those in a `described` batch: a
    batch reads what arrived during the one before, so a loaded instance's described batches may
    reach back half a minute, to before a hot set moved, and rank the pids it left above the ones it
    reached (docs/load-model.md, "Arrival rates"). A pid not read in a described batch, or read only once, has
    no rate.
    """
    records: dict[int, list[tuple[int, int, bool]]] = {}
    for i, batches in history.items():
        recent = {id(b) for b in described.get(i, ())}
        for b in batches:
            for p, s in b["pids"].items():
                if s["in"] > 0 and s.get("newest_ms", 0) > 0:
                    records.setdefault(int(p), []).append((s["newest_ms"], s["in"], id(b) in recent))
    rates = {}
    for p, rs in records.items():
        rs.sort()
        described_from = next((k for k, r in enumerate(rs) if r[2]), None)
        if described_from is None or len(rs) < 2:
            continue
        least = max(described_from, 1)  # the run needs a record before it
        newest_ms = rs[-1][0]
        covering = (
            k for k in range(len(rs) - 1, least - 1, -1) if newest_ms - rs[k - 1][0] >= RATE_SPAN_S * 1000
        )
        start = next(covering, least)
        span_s = (newest_ms - rs[start - 1][0]) / 1000.0
        if span_s > 0:
            rates[p] = sum(r[1] for r in rs[start:]) / span_s
    return rates


def in_flight_reading(
    history: Sequence[dict[str, Any]], readings: Sequence[dict[str, Any]], streams: int
) -> dict[str, Any] | None:
    """What an instance's batch in flight has read, as a record with a batch's `pids` (None if nothing):
    its read reports (`pipeline.source.report_reading`) newer than its latest batch record, the newest
    per (pid, stream), since a task that runs again reports again. A pid counts once all its `streams`
    have been reported: a pid's streams are often read by different tasks, and until the second has
    reported, the first alone would show the pid at a fraction of its rate over the whole span."""
    since = history[-1]["time_ms"] if history else float("-inf")
    ranges: dict[tuple[int, int], dict[str, Any]] = {}
    for report in sorted(readings, key=lambda r: r["time_ms"]):
        if report["time_ms"] > since:
            ranges |= {(r["pid"], r["stream"]): r for r in report["ranges"]}
    read: dict[int, list[dict[str, Any]]] = {}
    for (p, _), r in sorted(ranges.items()):
        read.setdefault(p, []).append(r)
    pids = {
        str(p): {"in": sum(r["in"] for r in rs), "newest_ms": max(r["newest_ms"] for r in rs)}
        for p, rs in read.items()
        if len(rs) == streams
    }
    return {"pids": pids} if pids else None


def warming_up(history: Sequence[dict[str, Any]], reading: dict[str, Any] | None) -> bool:
    """Whether an instance's input has just begun: its batch in flight is its first with input
    (`reading`, `in_flight_reading`), or that first one has ended, after one that read none, and the
    next has not yet reported reading every pid it read (`history`, oldest first).

    Its load is not measured until then. A pid read once has no arrival rate (`arrival_rates`), and
    without a finished batch with input a tuple's cost to it is unknown: in the skew benchmark a hot
    instance inside its first batch with input read as nearly idle and received pids, and so did one
    whose first batch had ended just before the round, its pids counted at a fraction of their rate
    (docs/load-model.md, "Warm-up"). It lasts one batch and the reading of the next."""
    read = [b for b in history if b["tuples_in"] > 0]
    if not read:
        return reading is not None and any(s["in"] > 0 for s in reading["pids"].values())
    if len(read) > 1 or history[-1] is not read[0] or len(history) < 2:
        return False
    first = {p for p, s in read[0]["pids"].items() if s["in"] > 0}
    return not first <= set(reading["pids"] if reading else ())
