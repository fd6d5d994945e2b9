"""Scaling plans: which pids move when a pipeline's instance count changes, and what the operator does next.

Pure (no Kubernetes, no Kafka, no clock): the operator observes the desired replica count, the assignment
of record, the moves in flight and the instances that report ready, and `plan_step` turns them into one
`Plan`: how many instances the StatefulSet must have now and which single action comes next. Because the
plan is a function of what is observed, running it twice on the same observations gives the same plan,
which is what makes the reconcile loop level-triggered and idempotent.

Two rules keep every pid owned: the StatefulSet is never narrower than the highest ordinal that owns a pid
or takes part in a move (`Plan.width`), and no new moves are planned while others are in flight, so a
plan is always computed from a settled assignment. Scale-out gives each new instance an even share taken
from the instances with the most pids; scale-in moves every pid off the ordinals being removed onto the
instances that stay, fewest pids first. Both move as few pids as their goal allows.

This module must not know how a move is carried out (the `PidMover` behind the operator) or which pids a
load-balancing policy would prefer (`policies/`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from controller.assignment import Assignment, HandoffMode, Move, initial_assignment


def instance_name(pipeline: str, ordinal: int) -> str:
    """The StatefulSet pod name of an ordinal, which is also the instance id in the assignment."""
    if ordinal < 0:
        raise ValueError(f"ordinal must be >= 0, got {ordinal}")
    return f"{pipeline}-{ordinal}"


def ordinal_of(pipeline: str, instance: str) -> int:
    """The ordinal of one of `pipeline`'s instances; ValueError for a name that is not one of its pods."""
    prefix = f"{pipeline}-"
    suffix = instance[len(prefix) :] if instance.startswith(prefix) else ""
    if not suffix.isdigit() or (suffix != "0" and suffix.startswith("0")):
        raise ValueError(f"{instance!r} is not an instance of pipeline {pipeline!r} (<name>-<ordinal>)")
    return int(suffix)


def _counts(assignment: Assignment, instances: Sequence[str]) -> dict[str, list[int]]:
    """instance -> its pids (ascending) for the given instances, in the given order."""
    grouped = assignment.by_instance()
    return {instance: list(grouped.get(instance, ())) for instance in instances}


def plan_scale_out(
    assignment: Assignment,
    new_instances: Sequence[str],
    mode: HandoffMode = HandoffMode.TRANSFER,
    *,
    total: int | None = None,
) -> tuple[Move, ...]:
    """Moves that give each of `new_instances` (which own nothing) an even share of the pids.

    `total` is the number of instances once the whole scale-out is done (default: the owners and the new
    instances); when some new instances are not ready yet, the ready ones get their final share now and
    the others theirs later, so no pid has to move twice.

    With P = q * M + r pids on M = total instances, r instances may keep q + 1 pids. Those
    slots go first to current owners that already hold more than q (so their extra pid need not move),
    then to the new instances in the given order; every new instance receives q or q + 1 pids and no more
    pids move than that. Each pid is taken from the owner with the most pids at that point (the first in
    ordinal order on a tie), highest pid first, and the new instances are served in turn so that each gets
    pids from several owners. Moves come out sorted by pid.
    """
    donors = _sorted_instances(assignment.instances)
    overlap = set(new_instances) & set(donors)
    if overlap:
        raise ValueError(f"new instances already own pids: {sorted(overlap)}")
    if len(set(new_instances)) != len(new_instances):
        raise ValueError(f"new instances must be distinct: {list(new_instances)}")
    if not new_instances:
        return ()
    partitions = len(assignment.owners)
    total = max(total or 0, len(donors) + len(new_instances))
    if partitions < total:
        raise ValueError(f"{partitions} pids cannot give a pid to each of {total} instances")
    quota, extra = divmod(partitions, total)
    holdings = _counts(assignment, donors)
    extra_for_new = extra - min(extra, sum(1 for d in donors if len(holdings[d]) > quota))
    wanted = {target: quota + (1 if i < extra_for_new else 0) for i, target in enumerate(new_instances)}
    moves: list[Move] = []
    for round_ in range(max(wanted.values())):
        for target in new_instances:
            if round_ < wanted[target]:
                source = max(donors, key=lambda d: (len(holdings[d]), -donors.index(d)))
                moves.append(Move(holdings[source].pop(), source, target, mode))
    return tuple(sorted(moves, key=lambda m: m.pid))


def plan_scale_in(
    assignment: Assignment,
    drained: Collection[str],
    remaining: Sequence[str],
    mode: HandoffMode = HandoffMode.TRANSFER,
) -> tuple[Move, ...]:
    """Moves that take every pid off `drained` onto `remaining`, each to the one with the fewest pids.

    Only the drained instances' pids move (every one of them must), and pids already on the remaining
    instances stay put. Pids are placed in ascending order; ties go to the first remaining instance in
    the given order. Moves come out sorted by pid.
    """
    if not remaining:
        raise ValueError("scale-in needs at least one remaining instance")
    overlap = set(drained) & set(remaining)
    if overlap:
        raise ValueError(f"instances both drained and remaining: {sorted(overlap)}")
    holdings = {instance: len(pids) for instance, pids in _counts(assignment, remaining).items()}
    moves: list[Move] = []
    for pid, owner in assignment.owners.items():
        if owner not in drained:
            continue
        target = min(remaining, key=lambda r: (holdings[r], remaining.index(r)))
        holdings[target] += 1
        moves.append(Move(pid, owner, target, mode))
    return tuple(moves)


def _sorted_instances(instances: Collection[str]) -> list[str]:
    """Instance ids in ordinal order ("x-2" before "x-10"), names without an ordinal last by name."""

    def key(instance: str) -> tuple[int, int, str]:
        _, _, suffix = instance.rpartition("-")
        return (0, int(suffix), instance) if suffix.isdigit() else (1, 0, instance)

    return sorted(instances, key=key)


class StepKind(Enum):
    """The one action a plan asks for next; the order of the members is the order they are checked in."""

    START = "start"
    """No assignment of record yet: publish the initial one (epoch 0) over ordinals 0..replicas-1."""
    AWAIT_MOVES = "await_moves"
    """Moves are in flight: plan nothing new until they complete."""
    DRAIN = "drain"
    """Ordinals >= replicas, or stopping instances, own pids: move them all onto the instances that stay."""
    SPREAD = "spread"
    """Instances below replicas own nothing and report ready: move an even share onto them."""
    AWAIT_READY = "await_ready"
    """Instances below replicas own nothing and are not ready yet: wait for their heartbeat."""
    STEADY = "steady"
    """Every instance below replicas owns pids and nothing is draining: nothing to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What the operator does next for one pipeline.

    width: the StatefulSet's replica count now; never below an ordinal that owns a pid or takes part in
    a move, so a drained instance keeps running until its last pid has left.
    initial: the assignment to publish (START only); moves: the moves to request (DRAIN and SPREAD only).
    reason: one line for status and logs.
    """

    kind: StepKind
    width: int
    reason: str
    moves: tuple[Move, ...] = ()
    initial: Assignment | None = None


def _width(pipeline: str, replicas: int, assignment: Assignment, in_flight: Sequence[Move]) -> int:
    """Replicas, or more while a higher ordinal owns a pid or takes part in a move.

    Every owner must be one of the pipeline's pods (ValueError otherwise); a move endpoint that is not
    (a mover may not know the source of a handoff it resumed) does not widen anything.
    """
    ordinals = [ordinal_of(pipeline, name) for name in set(assignment.owners.values())]
    for move in in_flight:
        for name in (move.source, move.target):
            try:
                ordinals.append(ordinal_of(pipeline, name))
            except ValueError:
                continue
    return max([replicas, *(ordinal + 1 for ordinal in ordinals)])


def plan_step(
    *,
    pipeline: str,
    partitions: int,
    replicas: int,
    assignment: Assignment | None,
    in_flight: Sequence[Move],
    ready: Collection[str],
    mode: HandoffMode = HandoffMode.TRANSFER,
    stopping: Collection[str] = (),
) -> Plan:
    """The next step for a pipeline that wants `replicas` instances, from what is observed now.

    `stopping`: instances to drain before they stop (a planned restart, decision 0056); they take no
    pids meanwhile, and their pids go to the others like those of an instance scaled in.

    Raises ValueError for observations no step can fix (an owner that is not one of the pipeline's pods,
    fewer pids than replicas), so that the operator reports them instead of acting on them.
    """
    if not 1 <= replicas <= partitions:
        raise ValueError(f"replicas must be in 1..{partitions} (the pid count), got {replicas}")
    if assignment is None:
        initial = initial_assignment(partitions, [instance_name(pipeline, i) for i in range(replicas)])
        return Plan(
            kind=StepKind.START,
            width=replicas,
            initial=initial,
            reason=f"publish epoch 0: {partitions} pids on {replicas} instances",
        )
    width = _width(pipeline, replicas, assignment, in_flight)
    if in_flight:
        return Plan(kind=StepKind.AWAIT_MOVES, width=width, reason=f"{len(in_flight)} pid moves in flight")

    holdings: Mapping[str, tuple[int, ...]] = assignment.by_instance()
    wanted = [instance_name(pipeline, i) for i in range(replicas)]
    drained = [
        name
        for name in _sorted_instances(holdings)
        if ordinal_of(pipeline, name) >= replicas or name in stopping
    ]
    idle = [name for name in wanted if name not in holdings]
    idle_ready = [name for name in idle if name in ready and name not in stopping]
    if drained:
        targets = [
            name
            for name in wanted
            if (name in holdings or name in ready) and name not in drained and name not in stopping
        ]
        if not targets:
            return Plan(
                kind=StepKind.AWAIT_READY,
                width=width,
                reason="no instance that stays owns pids or is ready to take those of " + ", ".join(drained),
            )
        moves = plan_scale_in(assignment, drained, targets, mode)
        return Plan(
            kind=StepKind.DRAIN,
            width=width,
            moves=moves,
            reason=f"drain {len(moves)} pids off {', '.join(drained)}",
        )
    if idle_ready:
        moves = plan_scale_out(assignment, idle_ready, mode, total=replicas)
        return Plan(
            kind=StepKind.SPREAD,
            width=width,
            moves=moves,
            reason=f"spread {len(moves)} pids onto {', '.join(idle_ready)}",
        )
    if idle:
        return Plan(
            kind=StepKind.AWAIT_READY,
            width=width,
            reason=f"waiting for {', '.join(idle)} to report ready",
        )
    return Plan(kind=StepKind.STEADY, width=width, reason=f"{replicas} instances own all {partitions} pids")
