"""`fluxjoin controller`: the local control loop, collect -> decide -> execute.

Collect: the observer's batch records over the last interval become a policy `Snapshot` (busy fraction
per instance, tuples and state per pid). Decide: the configured policy, a pure function. Execute: the
`KafkaPidMover` turns the decision's moves into protocol steps, and every tick it also advances the moves
in flight, serves `fluxjoin move` requests and recovers dead instances. `--dry-run` prints decisions
without executing them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from controller.assignment import Assignment, HandoffMode, initial_assignment
from controller.moves import KafkaPidMover
from controller.policies import POLICIES
from controller.policies.base import InstanceStats, PidStats, Snapshot
from pipeline.config import Config

TICK_S = 0.25


def instance_names(count: int) -> list[str]:
    return [f"instance-{i}" for i in range(count)]


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
    """Statistics of the last `interval_s` seconds (by batch end time) as a policy snapshot."""
    since = now_ms - interval_s * 1000
    busy: dict[str, float] = dict.fromkeys(live, 0.0)
    state: dict[str, dict[int, int]] = {i: {} for i in live}
    tuples: dict[int, int] = {}
    for b in batches:
        name = b["instance"]
        if name not in busy:
            continue
        for p, s in b["pids"].items():
            state[name][int(p)] = s["state_bytes"]  # newest record wins
        if b["time_ms"] < since:
            continue
        busy[name] += b["duration_s"]
        for p, s in b["pids"].items():
            tuples[int(p)] = tuples.get(int(p), 0) + s["in"]
    owned = {p: o for p, o in assignment.owners.items() if o in busy}
    instances = tuple(
        InstanceStats(
            instance=i,
            busy_fraction=min(1.0, busy[i] / interval_s),
            state_bytes=sum(v for p, v in state[i].items() if owned.get(p) == i),
        )
        for i in sorted(live)
    )
    pid_state = {p: v for i in live for p, v in state[i].items() if owned.get(p) == i}
    pids = {
        p: PidStats(pid=p, tuples=tuples.get(p, 0), state_bytes=pid_state.get(p, 0), results=0)
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


def run_controller(
    cfg: Config,
    bootstrap: str,
    policy_name: str,
    mode: HandoffMode,
    heartbeat_timeout_s: float,
    dry_run: bool = False,
    stop: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = print,
) -> None:
    """Run until `stop()`; publishes epoch 0 over `cfg.instances` instances if the log has none."""
    from pipeline.topics import ensure_topics

    ensure_topics(cfg, bootstrap)
    policy = POLICIES[policy_name]
    params = policy.default_params()
    if hasattr(params, "mode"):
        params = replace(params, mode=mode)
    mover = KafkaPidMover(cfg, bootstrap, heartbeat_timeout_s, say=say)
    mover.start(initial_assignment(cfg.partitions, instance_names(cfg.instances)))
    interval = float(getattr(params, "delta_s", 2.0))
    next_decision = time.monotonic() + max(interval, 5.0)  # let the instances report first
    last_adaptation: float | None = None
    last_reason = ""
    say(
        f"controller: policy {policy_name}, handoff {mode.value}, heartbeat timeout {heartbeat_timeout_s:g} s"
    )
    try:
        while not stop():
            mover.step()
            now = time.monotonic()
            if now >= next_decision:
                interval, moved, reason = _decide(
                    mover, policy, params, interval, now, last_adaptation, dry_run, say
                )
                if moved:
                    last_adaptation = now
                elif reason != last_reason:
                    say(f"policy {policy_name}: no move ({reason})")
                last_reason = reason
                next_decision = now + interval
            time.sleep(TICK_S)
    finally:
        mover.close()


def _decide(
    mover: KafkaPidMover,
    policy: Any,
    params: Any,
    interval: float,
    now: float,
    last_adaptation: float | None,
    dry_run: bool,
    say: Callable[[str], None],
) -> tuple[float, bool, str]:
    """One policy round; returns the next interval, whether moves were ordered, and the reason."""
    current = mover.assignment()
    if current is None:
        return interval, False, "no assignment yet"
    in_flight = frozenset(m.pid for m in mover.in_flight())
    live = sorted(mover.observer.liveness().live)
    snapshot = snapshot_of(
        mover.observer.batches, live, current, in_flight, time.time() * 1000, interval, now, last_adaptation
    )
    started = time.monotonic()
    decision = policy.decide(snapshot, params)
    if not decision.moves:
        return decision.next_interval_s or interval, False, decision.reason
    for move in decision.moves:
        say(f"policy {policy.name}: pid {move.pid} {move.source} -> {move.target} ({decision.reason})")
    if dry_run:
        return decision.next_interval_s or interval, False, decision.reason
    mover.request(decision.moves)
    # Flux: the next interval is as long as the move phase (None); wait for the moves to finish.
    while decision.next_interval_s is None and mover.in_flight():
        mover.step()
        time.sleep(TICK_S)
    phase = time.monotonic() - started
    return decision.next_interval_s or max(phase, 0.25), True, decision.reason
