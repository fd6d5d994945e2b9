"""A policy's rounds over time: collect statistics for an interval, decide, carry out, repeat.

The policies are pure functions of a `Snapshot` (decision 0005); what they carry from round to round (the
collection interval, the time of the last adaptation, a move phase in progress) lives here, so that the
local controller (`controller.runner`) and the Kubernetes operator (`controller.operator`) run a policy
the same way. `tick` never blocks: a caller ticks it from its own loop, and a round whose moves are still
in flight (Flux's move phase) simply ends when they have completed.

A move phase ends when every moved pid has left its source: the assignment of record then gives it to
its new owner, and the snapshot charges its arrival rate there (`snapshot_of`). Neither the new
owner's first batch with the pid, which reads the backlog since the cutoff and can be long when the
source was behind, nor a parallel track's tail (the source finishing the pid's old tuples) holds up
the next round; the pid stays out of the policy's reach until its move is over
(`Snapshot.moves_in_flight`; decisions 0013, 0014).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from controller.assignment import Assignment, HandoffMode, Move
from controller.policies import POLICIES, Decision, InstanceStats, PidStats, Policy, Snapshot

FIRST_ROUND_DELAY_S = 5.0
"""The first round waits at least this long, so that every instance has reported a few batches."""
MIN_INTERVAL_S = 0.25
"""Floor of the interval after a move phase for policies without their own minimum (Flux has delta_min)."""


class PolicyMover(Protocol):
    """What a policy round needs from whoever carries out moves."""

    def releasing(self) -> Sequence[Move]:
        """Moves whose pid its source has not released yet (a handoff on its way to the new owner, or a
        parallel track's tail, is not one)."""
        ...

    def request(self, moves: Sequence[Move]) -> None: ...

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        """Statistics of the last `interval_s` seconds, or None while there is no assignment yet."""
        ...


def policy_params(name: str, mode: HandoffMode, **overrides: Any) -> Any:
    """The policy's default parameters with `overrides` and the handoff mode its moves should use.

    A command line passes every value as a float: 0 or 1 for a yes/no parameter becomes a bool, a whole
    number for an integer parameter an int; any other value for either is refused, not truncated."""
    params = POLICIES[name].default_params()
    if hasattr(params, "mode"):
        overrides["mode"] = mode
    for key, value in overrides.items():
        if not isinstance(value, float):
            continue
        if isinstance(getattr(params, key, None), bool):
            if value not in (0.0, 1.0):
                raise ValueError(f"{key} is yes (1) or no (0), got {value}")
            overrides[key] = value == 1.0
        elif isinstance(getattr(params, key, None), int):
            if not value.is_integer():
                raise ValueError(f"{key} must be a whole number, got {value}")
            overrides[key] = int(value)
    return replace(params, **overrides)


def busy_fraction(batches: Sequence[dict[str, Any]]) -> float:
    """The share of the time these batches cover that the instance spent inside them.

    A batch record's period runs from the end of the instance's previous batch to its own end (its
    `busy` is duration / period), so durations over periods measure utilization whatever the
    collection interval. A plain sum of durations over a window shorter than a batch reads 0 or more
    than 1 depending on whether a batch happened to end inside it, and micro-batches of a loaded
    instance last seconds.
    """
    period = _period_s(batches)
    return min(1.0, sum(b["duration_s"] for b in batches) / period) if period > 0 else 0.0


def _period_s(batches: Sequence[dict[str, Any]]) -> float:
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
    measured directly; in a steady spell every batch reads about as many tuples, the line's intercept
    is poorly determined, and it was measured at 3.5-4.2 s where empty batches took 2.2-2.8 s
    (decision 0029).

    Before MIN_FIT_BATCHES batches, or with tuple counts all alike, it is the shortest batch that read
    nothing (an instance's second batch, before its input starts, or a release), no longer than the
    shortest batch, else 0, unknown. A round early in the input would otherwise charge a near-idle
    instance's whole batch time to its few tuples, read it as nearly busy, and refuse it a hot pid
    (decision 0019)."""
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
    period = _period_s(described)
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
    says nothing of a tuple's cost: early in the input, an instance's warm-up batch (15 s, Spark
    starting) counted as per-tuple time made a near-idle instance's tuple cost 28 ms, not 1 ms
    (decision 0019)."""
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
    above 1), and one catching up advances more than it takes (below 1). It needs no cost model: in run
    AC a donor left with five hot pids read a modelled demand of 0.47-0.78 while its batches grew from
    15 s to 36 s (decision 0032).

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
    reached (decision 0018). A pid not read in a described batch, or read only once, has no rate.
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
    instance inside its first batch with input read U 0.11 and received seven pids, and one whose
    first batch had ended 30 ms before the round read U 0.58, its pids counted at a sixth of their
    rate, and received four (decision 0019). It lasts one batch and the reading of the next."""
    read = [b for b in history if b["tuples_in"] > 0]
    if not read:
        return reading is not None and any(s["in"] > 0 for s in reading["pids"].values())
    if len(read) > 1 or history[-1] is not read[0] or len(history) < 2:
        return False
    first = {p for p, s in read[0]["pids"].items() if s["in"] > 0}
    return not first <= set(reading["pids"] if reading else ())


def first_of_new_input(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches of an instance's `history` (oldest first) that read input after one that read none:
    the first batch of new input pays for compiling the join, and its cost per tuple on a near-idle
    instance (9.6 ms in the skew benchmark) is several times a later batch's (1.5 ms)."""
    return [
        b for k, b in enumerate(history) if k > 0 and b["tuples_in"] > 0 and history[k - 1]["tuples_in"] == 0
    ]


def snapshot_of(
    batches: list[dict[str, Any]],
    live: list[str],
    assignment: Assignment,
    in_flight: frozenset[int],
    now_ms: float,
    interval_s: float,
    now_s: float,
    last_adaptation_s: float | None,
    readings: Sequence[dict[str, Any]] = (),
    streams: int = 1,
    arrivals: Mapping[int, float] | None = None,
    empty_s: Mapping[str, float] | None = None,
) -> Snapshot:
    """Statistics of the instances' batch records that ended in the last `interval_s` seconds (or of
    each one's latest batch, `described_by`); the fixed cost of an instance's batches is fitted on all
    its records at hand (the observer keeps two minutes).

    A pid's tuples (Flux's N_p) are its arrival rate (`arrival_rates`) over the interval. Without a
    rate (a pid's first record), its instances' counts are scaled to `interval_s` by the periods their
    described batches cover: a loaded instance's one batch may cover a minute while an idle one's
    cover the interval, and Flux's estimates compare a donor's pid with the receiver's total. Its
    results (the memory policy's P_o) are its described batches' counts, scaled the same way.

    The rates count what instances' batches in flight have read (`readings` of the pipeline's
    `streams`, `in_flight_reading`): a loaded instance's batch lasts long, and a hot set that arrived
    during its last one would otherwise show only when the next one ends. Where the input's tail gives
    a pid's rate now (`arrivals`, `controller.arrivals.InputTail`), that rate counts instead: an
    instance that is behind has not read what arrives now at all (decision 0024). `empty_s` gives
    each instance's shortest batch that read nothing so far, a bound on its fixed cost that outlasts
    the history (`fixed_cost_s`).

    An instance's demand is the share of its time it needs to keep up with the pids the assignment
    gives it: its fixed per-batch share plus, per pid, the pid's arrival rate times the cost per tuple
    of whoever read its tuples (`cost_per_tuple_s`). A pid moved away leaves its old owner's demand
    as soon as the assignment says so, though a parallel track's source still reads its old tuples,
    and joins its new owner's at the cost it had where it was read. A backlog does not count: an
    instance behind its input reads more per batch, not more per second of arrivals (decision 0014).
    Where the instance's own progress says it needs more (`demand_from_progress`), that counts
    instead: the cost per tuple is an average, and a hot key's tuple costs many times a cold one's
    (decision 0032).
    """
    since = now_ms - interval_s * 1000
    history: dict[str, list[dict[str, Any]]] = {i: [] for i in live}
    state: dict[str, dict[int, int]] = {i: {} for i in live}
    for b in batches:
        name = b["instance"]
        if name not in history:
            continue
        for p, s in b["pids"].items():
            state[name][int(p)] = s["state_bytes"]  # newest record wins
        history[name].append(b)
    described = {i: described_by(history[i], since) for i in live}
    read: dict[int, dict[str, float]] = {}
    produced: dict[int, float] = {}
    for i, own in described.items():
        period = _period_s(own)
        per_interval = interval_s / period if period > 0 else 1.0
        for b in own:
            for p, s in b["pids"].items():
                by = read.setdefault(int(p), {})
                by[i] = by.get(i, 0.0) + s["in"] * per_interval
                produced[int(p)] = produced.get(int(p), 0.0) + s.get("results", 0) * per_interval
    reading = {
        i: in_flight_reading(history[i], [r for r in readings if r["instance"] == i], streams) for i in live
    }
    extra = {i: [r] if r else [] for i, r in reading.items()}
    measured = arrival_rates(
        {i: history[i] + extra[i] for i in live}, {i: described[i] + extra[i] for i in live}
    )
    rates = {p: measured.get(p, sum(by.values()) / interval_s) for p, by in read.items()} | measured
    rates |= arrivals or {}
    fixed_s = {i: fixed_cost_s(history[i], (empty_s or {}).get(i)) for i in live}
    busy = {}
    cost = {}
    for i in live:
        # The first batch of new input pays for compiling the join (decision 0019): it says nothing
        # of a tuple's cost, nor of how busy the instance is, where there are other batches.
        first = {id(b) for b in first_of_new_input(history[i])}
        described_steady = [b for b in described[i] if id(b) not in first]
        busy[i] = split_busy(described_steady or described[i], fixed_s[i])
        # A tuple's cost from the described batches, else the others at hand: a release without
        # reading (decision 0015) says nothing of it.
        steady = [b for b in history[i] if id(b) not in first]
        cost[i] = (
            cost_per_tuple_s(described_steady, fixed_s[i])
            or cost_per_tuple_s(steady, fixed_s[i])
            or cost_per_tuple_s(described[i], fixed_s[i])
            or cost_per_tuple_s(history[i], fixed_s[i])
        )
    owned = {p: o for p, o in assignment.owners.items() if o in history}
    demand = {i: busy[i][1] for i in live}
    for p, owner in owned.items():
        readers = {i: n for i, n in read.get(p, {}).items() if n > 0 and cost.get(i) is not None}
        if readers:
            per_tuple = sum(n * (cost[i] or 0.0) for i, n in readers.items()) / sum(readers.values())
        else:
            per_tuple = cost[owner] or 0.0
        demand[owner] += rates.get(p, 0.0) * per_tuple
    progress = {i: demand_from_progress(history[i], set(assignment.pids_of(i))) for i in live}
    for i in live:
        demand[i] = max(demand[i], progress[i] or 0.0)
    instances = tuple(
        InstanceStats(
            instance=i,
            busy_fraction=busy[i][0],
            fixed_busy=busy[i][1],
            demand=demand[i],
            progress=progress[i],
            state_bytes=sum(v for p, v in state[i].items() if owned.get(p) == i),
        )
        for i in sorted(live)
    )
    pid_state = {p: v for i in live for p, v in state[i].items() if owned.get(p) == i}
    pids = {
        p: PidStats(
            pid=p,
            tuples=round(rates.get(p, 0.0) * interval_s),
            state_bytes=pid_state.get(p, 0),
            results=round(produced.get(p, 0.0)),
        )
        for p in sorted(set(rates) | set(pid_state))
        if p in owned
    }
    return Snapshot(
        now_s=now_s,
        instances=instances,
        pids=pids,
        assignment=assignment,
        moves_in_flight=in_flight,
        interval_s=interval_s,
        last_adaptation_s=last_adaptation_s,
        warming=frozenset(i for i in live if warming_up(history[i], reading[i])),
    )


@dataclass
class PolicyRounds:
    """One policy's round schedule and the state it carries between rounds (times on a monotonic clock)."""

    policy: Policy[Any]
    params: Any
    interval_s: float
    next_round_s: float
    last_adaptation_s: float | None = None
    move_phase_since_s: float | None = None
    """Set while the moves of a round whose next interval is "as long as the move phase" are in flight."""
    last_snapshot: Snapshot | None = None
    """What the latest round decided on."""

    @classmethod
    def begin(cls, name: str, params: Any, now_s: float | None = None) -> PolicyRounds:
        now = time.monotonic() if now_s is None else now_s
        interval = float(getattr(params, "delta_s", 2.0))
        return cls(POLICIES[name], params, interval, now + max(interval, FIRST_ROUND_DELAY_S))

    def tick(self, mover: PolicyMover, now_s: float | None = None, dry_run: bool = False) -> Decision | None:
        """Run the round that is due, if one is: its decision, whose moves were requested unless `dry_run`.

        None when no round ran (not due yet, a move phase still running, no assignment yet, an
        instance warming up).
        """
        now = time.monotonic() if now_s is None else now_s
        if self.move_phase_since_s is not None:
            if mover.releasing():
                return None
            self._next_in(max(now - self.move_phase_since_s, self._delta_min_s()), now)
            self.move_phase_since_s = None
            return None
        if now < self.next_round_s:
            return None
        snapshot = mover.snapshot(self.interval_s, now, self.last_adaptation_s)
        if snapshot is None:
            self._next_in(self.interval_s, now)
            return None
        if snapshot.warming:
            return None  # tried again at the next tick: the instance's load is measured within a batch
        self.last_snapshot = snapshot
        decision = self.policy.decide(snapshot, self.params)
        interval = decision.next_interval_s
        if decision.moves and not dry_run:
            mover.request(decision.moves)
            self.last_adaptation_s = now
            if interval is None and getattr(self.params, "phase_interval", True):
                self.move_phase_since_s = now
                return decision
            # Without the paper's phase interval the next round does not wait for the releases: the
            # snapshot charges a moving pid to its new owner and leaves it out of the policy's reach,
            # and a loaded donor's release waits for its batch in flight (up to a minute, decision 0020).
            interval = interval or self._delta_min_s()
        self._next_in(interval or self.interval_s, now)
        return decision

    def _delta_min_s(self) -> float:
        """The shortest interval between rounds after one that moved pids."""
        return float(getattr(self.params, "delta_min_s", MIN_INTERVAL_S))

    def _next_in(self, interval_s: float, now_s: float) -> None:
        self.interval_s = interval_s
        self.next_round_s = now_s + interval_s
