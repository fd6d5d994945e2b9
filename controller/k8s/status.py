"""A pipeline's status subresource, and what it is rendered from: the instance pods as Kubernetes shows
them and what one reconcile observed.

Apart from the manifests because it is written on every round from observations, not from the spec
alone. Pure: it takes observed values and returns the plain dict the status subresource takes, with the
same times as `previous` while nothing changes, so that an unchanged pipeline is not written.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.assignment import Assignment, Move
from controller.k8s.manifests import selector_string
from controller.k8s.spec import PipelineSpec
from controller.policies.base import InstanceStats
from controller.scaling import Plan, StepKind, ordinal_of


def restarting_instances(pods: Sequence[Mapping[str, Any]], instances: Collection[str]) -> set[str]:
    """The instances whose pod Kubernetes is replacing or starting: missing (deleted, not yet recreated),
    terminating, or not Ready. Their silence is a restart, not a death, for a while (decision 0051)."""
    by_name = {pod["metadata"]["name"]: pod for pod in pods}
    restarting = set()
    for name in instances:
        pod = by_name.get(name)
        if pod is None or pod["metadata"].get("deletionTimestamp") or not pod_ready(pod):
            restarting.add(name)
    return restarting


def stopping_instances(pods: Sequence[Mapping[str, Any]]) -> set[str]:
    """The instances whose pod is terminating (deleted, by a rolling update, a drain or by hand): under
    a `drain` planned restart their pids move to the others while they wait (decision 0056)."""
    return {pod["metadata"]["name"] for pod in pods if pod["metadata"].get("deletionTimestamp")}


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def format_pids(pids: Iterable[int]) -> str:
    """Pids as ranges and single pids, ascending: (0, 1, 2, 5, 7, 8) -> '0-2,5,7-8'."""
    ordered = sorted(set(pids))
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        first, last = ordered[start], ordered[end]
        parts.append(str(first) if first == last else f"{first}-{last}")
        start = end + 1
    return ",".join(parts)


def _move_key(move: Mapping[str, Any]) -> tuple[int, str, str]:
    return (int(move["pid"]), str(move["from"]), str(move["to"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """What one reconcile saw after it acted: the inputs of `render_status`.

    plan: the plan for the state after the action (what the pipeline waits for now); decision: what
    this round did, None when it did nothing (status.lastDecision then keeps the previous one).
    """

    spec: PipelineSpec
    plan: Plan
    decision: str | None
    statefulset_replicas: int  # the plan's width, never below replicas or an owner's ordinal + 1
    assignment: Assignment | None
    in_flight: Sequence[Move]
    ready: Collection[str]
    stats: Mapping[str, InstanceStats]


def ready_reason(observed: Observed) -> tuple[bool, str]:
    """The Ready condition's status and reason (the STATUS column of `kubectl get jp`).

    Ready means every wanted instance exists, owns pids and reports ready, and no extra instance is left;
    the reason says what is going on either way (moves between ready instances keep Ready true).
    """
    spec, plan, assignment = observed.spec, observed.plan, observed.assignment
    if assignment is None or plan.kind is StepKind.START:
        return False, "Starting"
    owners = set(assignment.owners.values())
    wanted = spec.instances(spec.replicas)
    if observed.statefulset_replicas > spec.replicas:
        return False, "ScalingIn"
    if any(name not in owners for name in wanted):
        return False, "ScalingOut"
    if any(name not in observed.ready for name in wanted):
        return False, "InstancesNotReady"
    return True, "MovingPids" if observed.in_flight else "Running"


def ready_condition(
    ready: bool, reason: str, message: str, generation: int, previous: Mapping[str, Any], now: str
) -> dict[str, Any]:
    """The Ready condition; lastTransitionTime moves only when its status changes."""
    status = "True" if ready else "False"
    since = now
    for old in previous.get("conditions", []):
        if old.get("type") == "Ready" and old.get("status") == status:
            since = old.get("lastTransitionTime", now)
    return {
        "type": "Ready",
        "status": status,
        "observedGeneration": generation,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
    }


def failure_status(generation: int, message: str, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status fields a failed reconcile changes: everything else keeps what was last observed."""
    return {
        "lastDecision": message,
        "conditions": [ready_condition(False, "ReconcileFailed", message, generation, previous, now)],
    }


def render_status(observed: Observed, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The status subresource for what was observed; `previous` supplies the times that must not change
    while nothing changes (a move's startedAt, the Ready condition's lastTransitionTime)."""
    spec, assignment = observed.spec, observed.assignment
    status: dict[str, Any] = {
        "observedGeneration": spec.generation,
        "replicas": observed.statefulset_replicas,
        "selector": selector_string(spec.name),
    }
    holdings = assignment.by_instance() if assignment is not None else {}
    if assignment is not None:
        status["epoch"] = assignment.epoch
        status["assignment"] = [
            {"instance": name, "pids": format_pids(pids), "count": len(pids)}
            for name, pids in sorted(holdings.items(), key=lambda item: ordinal_of(spec.name, item[0]))
        ]
    status["readyReplicas"] = sum(1 for name in holdings if name in observed.ready)

    started = {_move_key(m): m.get("startedAt", now) for m in previous.get("moves", [])}
    moves = []
    for move in sorted(observed.in_flight, key=lambda m: m.pid):
        entry: dict[str, Any] = {"pid": move.pid, "from": move.source, "to": move.target}
        entry["mode"] = move.mode.value
        entry["startedAt"] = started.get(_move_key(entry), now)
        moves.append(entry)
    status["movesInFlight"] = len(moves)
    status["moves"] = moves

    instances = []
    for name in spec.instances(observed.statefulset_replicas):
        entry = {"name": name, "ready": name in observed.ready, "pids": len(holdings.get(name, ()))}
        stats = observed.stats.get(name)
        if stats is not None:
            entry["load"] = stats.busy_fraction
            entry["stateBytes"] = stats.state_bytes
            if stats.tuples_per_s is not None:
                entry["tuplesPerSecond"] = round(stats.tuples_per_s, 1)
            if stats.lag is not None:
                entry["lag"] = stats.lag
        instances.append(entry)
    status["instances"] = instances
    reported = [observed.stats[e["name"]] for e in instances if e["name"] in observed.stats]
    if reported:
        status["tuplesPerSecond"] = round(sum(s.tuples_per_s or 0.0 for s in reported), 1)
        status["lag"] = sum(s.lag or 0 for s in reported)

    status["lastDecision"] = observed.decision or previous.get("lastDecision") or observed.plan.reason
    ready, reason = ready_reason(observed)
    status["conditions"] = [
        ready_condition(ready, reason, observed.plan.reason, spec.generation, previous, now)
    ]
    return status
