"""When an instance counts as live or dead, judged from what the metrics topic says of it.

Pure rules over heartbeat times and the records' fields, apart from the observer that collects them
(`controller.observation.observer`): each is tested on its own, on the times it is given (decisions
0051, 0054).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
PROGRESS_TIMEOUT_S = 120.0
"""How long a serving instance's query may go without completing a batch or waiting between triggers
before the instance counts as dead although it heartbeats (a query hung in a task). Well above the
heartbeat timeout: one batch through a backlog legitimately runs for tens of seconds."""


@dataclass(frozen=True, slots=True)
class Liveness:
    """Which instances heartbeat (name -> incarnation), as the observer saw them."""

    live: Mapping[str, str]
    # Instances whose silence is confirmed (past the timeout, and past the controller's own start grace).
    dead: frozenset[str]
    # The last incarnation heard from each instance, live or dead (eviction names it).
    incarnations: Mapping[str, str] = field(default_factory=dict)
    # The newest epoch each instance's control follower had read at its last heartbeat.
    epochs: Mapping[str, int] = field(default_factory=dict)


def judge_liveness(
    now: float,
    *,
    started: float,
    heard: Mapping[str, float],
    expected: Collection[str],
    stalled_s: Mapping[str, float],
    timeout_s: float,
    progress_timeout_s: float,
    restarting: Collection[str],
    restart_grace_s: float,
) -> tuple[frozenset[str], frozenset[str]]:
    """(live, dead) among the instances heard from (`heard`: instance -> time of its last heartbeat) or
    expected. Live: heard within `timeout_s`, its query not stalled past `progress_timeout_s` (its pids
    would wait forever). Dead: stalled, or silent past `timeout_s`, or past `restart_grace_s` while its
    pod is being (re)started (`restarting`): until then a restarting instance is neither. One never heard
    from is silent since `started`; nobody is dead before the first `timeout_s` (nobody was heard yet)."""
    live = frozenset(
        i for i, t in heard.items() if now - t <= timeout_s and stalled_s.get(i, 0.0) <= progress_timeout_s
    )
    if now - started <= timeout_s:
        return live, frozenset()

    def dead_now(instance: str) -> bool:
        if stalled_s.get(instance, 0.0) > progress_timeout_s:
            return True
        allowed = max(timeout_s, restart_grace_s) if instance in restarting else timeout_s
        return now - heard.get(instance, started) > allowed

    return live, frozenset(i for i in (set(expected) | heard.keys()) - live if dead_now(i))


def query_stalled_s(heartbeat: Mapping[str, Any]) -> float | None:
    """How long an instance's query had gone without progress at its heartbeat, or None for a record
    that does not say. `stalled_ms` is timed on the instance's monotonic clock, which no step of its
    wall clock moves; an instance that does not send it is judged, as before, by its wall-clock time
    less its `progress_ms`, a difference a step of its clock between the two fakes."""
    if heartbeat.get("kind") != "heartbeat":
        return None
    if "stalled_ms" in heartbeat:
        return max(0.0, heartbeat["stalled_ms"] / 1000)
    if "progress_ms" in heartbeat and "time_ms" in heartbeat:
        return max(0.0, (heartbeat["time_ms"] - heartbeat["progress_ms"]) / 1000)
    return None
