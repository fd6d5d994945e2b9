"""A policy's rounds over time: collect statistics for an interval, decide, carry out, repeat.

The policies are pure functions of a `Snapshot` (decision 0005); what they carry from round to round (the
collection interval, the time of the last adaptation, a move phase in progress) lives here, so that the
local controller (`controller.runner`) and the Kubernetes operator (`controller.operator`) run a policy
the same way. `tick` never blocks: a caller ticks it from its own loop, and a round whose moves are still
in flight (Flux's move phase) simply ends when they have completed.

A move phase ends when every moved pid has reached its new owner. A parallel track's tail (the source
finishing the pid's old tuples, which lasts a window after the cutoff and longer when the source is
behind) does not hold up the next round: its pid stays out of the policy's reach until the tail ends
(`Snapshot.moves_in_flight`), and the snapshot charges each pid's work to its owner of record
(`snapshot_of`), so the work moved away is not counted twice (decision 0013).
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

    def cutting_over(self) -> Sequence[Move]:
        """Moves whose pid has not reached its new owner yet; a parallel track's tail is not one."""
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
"""Fewest batches a fixed-cost estimate is fitted on; with fewer the cost is unknown (0)."""


def fixed_cost_s(batches: Sequence[dict[str, Any]]) -> float:
    """Seconds one of the instance's batches costs whatever its input: the intercept of a least-squares
    line of batch duration against tuples read, kept within [0, the shortest batch] (a line that says
    more input costs less is noise, and no batch costs less than its fixed part). 0, unknown, with
    fewer than MIN_FIT_BATCHES batches or tuple counts all alike."""
    if len(batches) < MIN_FIT_BATCHES:
        return 0.0
    durations = [float(b["duration_s"]) for b in batches]
    try:
        _, intercept = statistics.linear_regression([float(b["tuples_in"]) for b in batches], durations)
    except statistics.StatisticsError:
        return 0.0
    return min(max(intercept, 0.0), min(durations))


def split_busy(described: Sequence[dict[str, Any]], history: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(busy_fraction(described), the part of it that is fixed per-batch cost, fitted on `history`)."""
    busy = busy_fraction(described)
    period = _period_s(described)
    fixed = fixed_cost_s(history) * len(described) / period if period > 0 else 0.0
    return busy, min(busy, fixed)


def demand(history: Sequence[dict[str, Any]], count: int) -> float | None:
    """The time the last `count` batches of `history` (oldest first) took over the time their input
    took to arrive; None if unknown.

    A batch reads what arrived while the batch before it ran and idled, so its input arrived over its
    predecessor's period (the first batch at hand stands in for its own). While an instance keeps up,
    this equals its busy fraction; when it falls behind, each batch takes longer than its input took to
    arrive and the figure exceeds 1, where a busy fraction stops (decision 0012).
    """
    if count <= 0 or not history:
        return None
    took = arrived = 0.0
    start = len(history) - count
    for k in range(max(start, 0), len(history)):
        source = history[k - 1] if k > 0 else history[k]
        if source["busy"] <= 0:
            continue
        took += history[k]["duration_s"]
        arrived += source["duration_s"] / source["busy"]
    return took / arrived if arrived > 0 else None


def described_by(history: Sequence[dict[str, Any]], since_ms: float) -> list[dict[str, Any]]:
    """The batches of one instance's `history` (oldest first) that ended at or after `since_ms`, else
    its latest batch: an instance with none ending in the interval is inside a longer batch (a loaded
    instance), and reading it as idle would send it more work. Empty before its first batch."""
    return [b for b in history if b["time_ms"] >= since_ms] or list(history[-1:])


def charged_to_owners(
    loads: Mapping[str, float],
    fixed: Mapping[str, float],
    processed: Mapping[str, Mapping[int, float]],
    owners: Mapping[int, str],
) -> dict[str, float]:
    """Each instance's load with the work its batches did charged to each pid's owner of record.

    `loads` are Flux's U per instance (demand or busy fraction), `fixed` the part of each that a
    batch costs whatever its input, `processed[i][p]` the tuples instance i processed for pid p. An
    instance's cost per tuple is its variable load over the tuples it processed. Work it did for a pid
    it no longer owns (a parallel track's old tuples, batches read before it released the pid) leaves
    its load; work another did for a pid it now owns joins it, at that other's cost per tuple. Without
    moves every pid is processed by its owner and the loads are unchanged. This lets a round run while
    a parallel track's tail is in flight without counting the moved work on both sides (decision 0013).
    """
    cost = {}
    for i, load in loads.items():
        total = sum(processed.get(i, {}).values())
        cost[i] = max(load - fixed.get(i, 0.0), 0.0) / total if total > 0 else 0.0
    charged = dict(loads)
    for i, counts in processed.items():
        for p, n in counts.items():
            owner = owners.get(p)
            if owner == i:
                continue
            charged[i] -= cost[i] * n
            if owner in charged:
                charged[owner] += cost[i] * n
    return {i: max(v, fixed.get(i, 0.0)) for i, v in charged.items()}


def snapshot_of(
    batches: list[dict[str, Any]],
    live: list[str],
    assignment: Assignment,
    in_flight: frozenset[int],
    now_ms: float,
    interval_s: float,
    now_s: float,
    last_adaptation_s: float | None,
) -> Snapshot:
    """Statistics of the instances' batch records that ended in the last `interval_s` seconds (or of
    each one's latest batch, `described_by`); the fixed cost of an instance's batches is fitted on all
    its records at hand (the observer keeps two minutes).

    A pid's tuples are its instances' counts scaled to `interval_s` by the periods their described
    batches cover: a loaded instance's one batch may cover a minute while an idle one's cover the
    interval, and Flux's estimates compare a donor's pid with the receiver's total (measured: a hot
    pid's 66 s of tuples against the receiver's 16 s made its move look 7 times too costly). An
    instance's demand is charged to the owners of record (`charged_to_owners`)."""
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
    processed: dict[str, dict[int, float]] = {i: {} for i in live}
    for i, own in described.items():
        period = _period_s(own)
        per_interval = interval_s / period if period > 0 else 1.0
        for b in own:
            for p, s in b["pids"].items():
                processed[i][int(p)] = processed[i].get(int(p), 0.0) + s["in"] * per_interval
    tuples: dict[int, float] = {}
    for counts in processed.values():
        for p, n in counts.items():
            tuples[p] = tuples.get(p, 0.0) + n
    busy = {i: split_busy(described[i], history[i]) for i in live}
    owned = {p: o for p, o in assignment.owners.items() if o in history}
    loads = {i: demand(history[i], len(described[i])) for i in live}
    charged = charged_to_owners(
        {i: busy[i][0] if d is None else d for i, d in loads.items()},
        {i: busy[i][1] for i in live},
        processed,
        owned,
    )
    instances = tuple(
        InstanceStats(
            instance=i,
            busy_fraction=busy[i][0],
            fixed_busy=busy[i][1],
            demand=charged[i],
            state_bytes=sum(v for p, v in state[i].items() if owned.get(p) == i),
        )
        for i in sorted(live)
    )
    pid_state = {p: v for i in live for p, v in state[i].items() if owned.get(p) == i}
    pids = {
        p: PidStats(pid=p, tuples=round(tuples.get(p, 0.0)), state_bytes=pid_state.get(p, 0), results=0)
        for p in sorted(set(tuples) | set(pid_state))
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

    @classmethod
    def begin(cls, name: str, params: Any, now_s: float | None = None) -> PolicyRounds:
        now = time.monotonic() if now_s is None else now_s
        interval = float(getattr(params, "delta_s", 2.0))
        return cls(POLICIES[name], params, interval, now + max(interval, FIRST_ROUND_DELAY_S))

    def tick(self, mover: PolicyMover, now_s: float | None = None, dry_run: bool = False) -> Decision | None:
        """Run the round that is due, if one is: its decision, whose moves were requested unless `dry_run`.

        None when no round ran (not due yet, a move phase still running, no assignment yet).
        """
        now = time.monotonic() if now_s is None else now_s
        if self.move_phase_since_s is not None:
            if mover.cutting_over():
                return None
            floor = float(getattr(self.params, "delta_min_s", MIN_INTERVAL_S))
            self._next_in(max(now - self.move_phase_since_s, floor), now)
            self.move_phase_since_s = None
            return None
        if now < self.next_round_s:
            return None
        snapshot = mover.snapshot(self.interval_s, now, self.last_adaptation_s)
        if snapshot is None:
            self._next_in(self.interval_s, now)
            return None
        decision = self.policy.decide(snapshot, self.params)
        if decision.moves and not dry_run:
            mover.request(decision.moves)
            self.last_adaptation_s = now
            if decision.next_interval_s is None:
                self.move_phase_since_s = now
                return decision
        self._next_in(decision.next_interval_s or self.interval_s, now)
        return decision

    def _next_in(self, interval_s: float, now_s: float) -> None:
        self.interval_s = interval_s
        self.next_round_s = now_s + interval_s
