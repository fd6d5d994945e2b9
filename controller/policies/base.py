"""What every policy reads and returns: observed statistics in, a `Decision` out.

A policy is a pure function `decide(snapshot, params) -> Decision` (decision 0005): everything it depends
on, including the state it carries from one round to the next (the current collection interval, the time
of the last adaptation), arrives in the frozen `Snapshot`, and everything it wants changed leaves in the
frozen `Decision`. Nothing here reads a clock, a topic or a random source, so the same snapshot always
gives the same decision and a policy is tested with plain values.

This module owns the value types and the `Policy` protocol; it must not know how statistics are collected
(observation) or how moves are carried out (the protocol and `handoff/`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from controller.assignment import Assignment, Move


@dataclass(frozen=True, slots=True)
class InstanceStats:
    """One live join instance over the last collection interval.

    busy_fraction is Flux's U_j = 1 - I_j / delta, already computed by the observer (0 = idle all the
    interval, 1 = never idle). fixed_busy is the part of it a micro-batch costs whatever its input (0 when
    unknown, the paper's model where all of U scales with the tuples). state_bytes is M_j, the memory
    its windows hold now; memory_limit_bytes is what it may hold (0 when unknown). demand is the share of
    its time it needs to keep up with the pids the assignment gives it: their arrival rates times their
    cost per tuple, plus the fixed part. It equals busy_fraction while the instance keeps up and exceeds
    1 when it falls behind, where busy_fraction stops at 1; a backlog being read does not count, and a
    moved pid counts for its new owner (`controller.observation.snapshot.snapshot_of`, docs/load-model.md,
    "Arrival rates" and 0032). None when unknown.
    """

    instance: str
    busy_fraction: float
    state_bytes: int
    memory_limit_bytes: int = 0
    fixed_busy: float = 0.0
    demand: float | None = None
    progress: float | None = None
    """The demand its own progress shows, one of the two figures `demand` is the larger of (decision
    0032); kept so that a round's log line says which one decided. None when not measured."""
    tuples_per_s: float | None = None
    """Input tuples it joined per second over the statistics interval (for status; no policy reads it)."""
    lag: int | None = None
    """Kafka messages behind the end of its pids' input partitions at its newest batch (for status)."""
    spilled_bytes: int = 0
    """Window state it has spilled out of memory and not cleaned up yet, at its newest batch
    (`pipeline.spill`): Flux's "partitions spilled to disk"."""

    @property
    def load(self) -> float:
        """Flux's U: the demand when measured (it can exceed 1), else the busy fraction."""
        return self.busy_fraction if self.demand is None else self.demand

    def __post_init__(self) -> None:
        if not 0.0 <= self.busy_fraction <= 1.0 or math.isnan(self.busy_fraction):
            raise ValueError(f"{self.instance}: busy_fraction must be in [0, 1], got {self.busy_fraction}")
        if not 0.0 <= self.fixed_busy <= self.busy_fraction:
            raise ValueError(
                f"{self.instance}: fixed_busy must be in [0, busy_fraction], got {self.fixed_busy}"
            )
        if self.demand is not None and not self.demand >= 0.0:
            raise ValueError(f"{self.instance}: demand must be >= 0, got {self.demand}")
        if self.state_bytes < 0 or self.memory_limit_bytes < 0:
            raise ValueError(f"{self.instance}: byte counts must be >= 0")


@dataclass(frozen=True, slots=True)
class PidStats:
    """One pid over the last collection interval: tuples processed (Flux's N_pid), the state it holds
    now (Liu & Rundensteiner's P_s) and the results it produced (their P_o)."""

    pid: int
    tuples: int
    state_bytes: int
    results: int
    spilled_bytes: int = 0
    """Its old generations' window, out of memory until its clean-up (`pipeline.spill`): a move of it
    first brings that back, so the memory policies move in-memory pids first."""

    def __post_init__(self) -> None:
        if min(self.pid, self.tuples, self.state_bytes, self.results, self.spilled_bytes) < 0:
            raise ValueError(f"pid stats must be >= 0: {self}")


def _frozen_pids(pids: Mapping[int, PidStats]) -> Mapping[int, PidStats]:
    return MappingProxyType({pid: pids[pid] for pid in sorted(pids)})


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Everything a policy may look at, observed at `now_s` (seconds on the controller's injected clock).

    instances: the live instances (an owner missing here is dead and is never chosen as a target).
    pids: statistics per pid; a pid without an entry counts as zero.
    moves_in_flight: pids whose move has been ordered but not completed; no policy touches them.
    interval_s: length of the collection interval the statistics cover (Flux's current delta).
    last_adaptation_s: when the last moves were ordered, on the same clock; None if never.
    warming: instances whose input has just begun, whose load is not measured yet
        (`controller.observation.rates.warming_up`); no round runs while there are any.
    """

    now_s: float
    instances: tuple[InstanceStats, ...]
    pids: Mapping[int, PidStats] = field(default_factory=dict)
    assignment: Assignment
    moves_in_flight: frozenset[int] = frozenset()
    interval_s: float
    last_adaptation_s: float | None = None
    warming: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        ids = [s.instance for s in self.instances]
        if len(set(ids)) != len(ids):
            raise ValueError(f"instance ids must be distinct: {ids}")
        for pid, stats in self.pids.items():
            if pid != stats.pid:
                raise ValueError(f"pid stats filed under {pid} are for pid {stats.pid}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        object.__setattr__(self, "pids", _frozen_pids(self.pids))
        object.__setattr__(self, "moves_in_flight", frozenset(self.moves_in_flight))

    def stats_of(self, instance: str) -> InstanceStats | None:
        """The statistics of a live instance, None if it is not live."""
        for stats in self.instances:
            if stats.instance == instance:
                return stats
        return None

    def tuples_of(self, pid: int) -> int:
        """N_pid, 0 for a pid nobody reported."""
        stats = self.pids.get(pid)
        return stats.tuples if stats is not None else 0

    def tuples_on(self, instance: str) -> int:
        """T_j: the tuples of the pids the assignment gives to the instance."""
        return sum(self.tuples_of(p) for p in self.assignment.pids_of(instance))

    def describe(self, largest: int = 3) -> str:
        """What a round read, one clause per instance: U (and the progress figure, when measured),
        busy fraction, fixed part, T_j over the interval and its `largest` pids by N_pid. A log line
        of it lets a round's choice be checked against its inputs afterwards."""
        clauses = []
        for s in self.instances:
            own = sorted(self.assignment.pids_of(s.instance), key=lambda p: (-self.tuples_of(p), p))
            tops = ", ".join(f"{p}:{self.tuples_of(p)}" for p in own[:largest])
            progress = f" progress {s.progress:.3f}" if s.progress is not None else ""
            clauses.append(
                f"{s.instance} U {s.load:.3f}{progress} busy {s.busy_fraction:.3f} "
                f"fixed {s.fixed_busy:.3f} T {self.tuples_on(s.instance)} [{tops}]"
            )
        return f"over {self.interval_s:g} s: " + "; ".join(clauses)


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy wants done, and why.

    An empty `moves` is an explicit "no change" and its `reason` says which rule held it back, so a
    dry run or a log can tell "balanced" from "waiting for the cooldown". next_interval_s is when the
    controller should next collect statistics and decide: a number of seconds, or None for "as long as
    the move phase this decision starts" (Flux's rule), which only the caller can measure.
    """

    moves: tuple[Move, ...]
    reason: str
    next_interval_s: float | None
    balanced: bool = False
    """The policy found the instances balanced by its own test (flux: the most and the least utilized
    instance within th_imb of each other), as opposed to held back by another rule."""
    spill: bool | None = None
    """Whether instances should spill at their spill threshold (True) or only past their whole budget
    (False): Liu and Rundensteiner's coupling, which spills locally only when no instance has room
    (`pipeline.protocol.SpillGateMsg`). None: the policy does not say."""

    @property
    def changes(self) -> bool:
        """Whether anything is to move."""
        return bool(self.moves)


ParamsT = TypeVar("ParamsT")


class Policy(Protocol[ParamsT]):
    """A pure decision rule: the same snapshot and params always give the same decision."""

    @property
    def name(self) -> str:
        """The name the configuration selects it by."""
        ...

    def default_params(self) -> ParamsT:
        """Its parameters with the defaults the papers give."""
        ...

    def decide(self, snapshot: Snapshot, params: ParamsT) -> Decision:
        """Moves to make now (possibly none), with the reason."""
        ...


def no_change(reason: str, next_interval_s: float | None, balanced: bool = False) -> Decision:
    """The explicit "nothing to do" decision."""
    return Decision((), reason, next_interval_s, balanced)


def registry_of(*policies: Policy[Any]) -> Mapping[str, Policy[Any]]:
    """Policies by name, read-only; refuses two policies with one name."""
    table: dict[str, Policy[Any]] = {}
    for policy in policies:
        if policy.name in table:
            raise ValueError(f"two policies named {policy.name!r}")
        table[policy.name] = policy
    return MappingProxyType(table)
