"""`fluxjoin controller`: the local control loop, collect -> decide -> execute.

Collect: the observer's batch records over the last interval become a policy `Snapshot` (busy fraction
per instance, tuples and state per pid). Decide: the configured policy, a pure function, in rounds
scheduled by `controller.rounds.PolicyRounds` (as in the Kubernetes operator). Execute: the
`KafkaPidMover` turns the decision's moves into protocol steps, and every tick it also advances the moves
in flight, serves `fluxjoin move` requests and recovers dead instances. `--dry-run` prints decisions
without executing them; `--decisions PATH` also appends each round's decision to PATH as a JSON line.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from controller.assignment import Assignment, initial_assignment
from controller.moves.kafka_mover import KafkaPidMover
from controller.policies import Decision
from controller.rounds import PolicyRounds
from pipeline.config import Config
from pipeline.topics import BrokerUnreachable, broker_away


def instance_names(count: int) -> list[str]:
    return [f"instance-{i}" for i in range(count)]


def run_controller(
    cfg: Config,
    bootstrap: str,
    policy_name: str,
    params: Any,
    heartbeat_timeout_s: float,
    dry_run: bool = False,
    stop: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = print,
    decisions: Path | None = None,
) -> None:
    """Run until `stop()`; publishes epoch 0 over `cfg.instances` instances if the log has none.

    `params` are the policy's (`controller.policies.params.policy_params`), handoff mode included. With
    `decisions`, each round's decision is also appended to that file (`append_decision`).
    """
    initial = initial_assignment(cfg.partitions, instance_names(cfg.instances))
    mover = KafkaPidMover(cfg, bootstrap, heartbeat_timeout_s, say=say)
    mover.start(initial)
    rounds = PolicyRounds.begin(policy_name, params)
    last_reason = ""
    say(f"controller: policy {policy_name} {params}, heartbeat timeout {heartbeat_timeout_s:g} s")
    try:
        while not stop():
            try:
                mover.step()
                decision = rounds.tick(mover, dry_run=dry_run)
            except (KafkaException, TimeoutError) as exc:
                if not broker_away(exc):
                    raise
                # Weather (decision 0052): start over from the control log once the broker is back,
                # as a restarted controller would, instead of going on from a step cut short.
                say(f"controller: Kafka at {bootstrap} is away ({_reason(exc)}); waiting for it")
                _close_quietly(mover)
                mover = _mover_once_back(cfg, bootstrap, heartbeat_timeout_s, initial, say, stop)
                say("controller: Kafka is back; resumed from the control log")
                continue
            if decision is not None:
                if rounds.last_snapshot is not None and rounds.last_snapshot.instances:
                    say(f"policy {policy_name} read {rounds.last_snapshot.describe()}")
                for move in decision.moves:
                    what = f"pid {move.pid} {move.source} -> {move.target}"
                    say(f"policy {policy_name}: {what} ({decision.reason})")
                if not decision.moves and decision.reason != last_reason:
                    say(f"policy {policy_name}: no move ({decision.reason})")
                last_reason = decision.reason
                if decisions is not None:
                    append_decision(decisions, policy_name, decision)
            mover.await_news()
    finally:
        _close_quietly(mover)


def append_decision(path: Path, policy_name: str, decision: Decision) -> None:
    """Append a round's decision to `path` as one JSON line: {"time": unix seconds, "policy", "moves":
    [[pid, source, target], ...], "reason", "balanced"}, for programs that follow the rounds."""
    moves = [[move.pid, move.source, move.target] for move in decision.moves]
    record = {
        "time": time.time(),
        "policy": policy_name,
        "moves": moves,
        "reason": decision.reason,
        "balanced": decision.balanced,
    }
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")


def _reason(exc: BaseException) -> str:
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error.str() if isinstance(error, KafkaError) else str(exc)


def _close_quietly(mover: KafkaPidMover) -> None:
    """Close a mover whose broker may be away: what it still holds unsent is a step that runs again."""
    with contextlib.suppress(KafkaException, TimeoutError, RuntimeError):
        mover.close()


def _mover_once_back(
    cfg: Config,
    bootstrap: str,
    heartbeat_timeout_s: float,
    initial: Assignment,
    say: Callable[[str], None],
    stop: Callable[[], bool],
) -> KafkaPidMover:
    """A new, started mover as soon as the broker answers again, trying every few seconds meanwhile."""
    pause_s = 1.0
    while True:
        try:
            mover = KafkaPidMover(cfg, bootstrap, heartbeat_timeout_s, say=say)
            mover.start(initial)
            return mover
        except (KafkaException, TimeoutError, BrokerUnreachable) as exc:
            if not isinstance(exc, BrokerUnreachable) and not broker_away(exc):
                raise
            if stop():
                raise
            time.sleep(pause_s)
            pause_s = min(10.0, pause_s * 2)
