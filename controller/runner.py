"""`fluxjoin controller`: the local control loop, collect -> decide -> execute.

Collect: the observer's batch records over the last interval become a policy `Snapshot` (busy fraction
per instance, tuples and state per pid). Decide: the configured policy, a pure function, in rounds
scheduled by `controller.rounds.PolicyRounds` (as in the Kubernetes operator). Execute: the
`KafkaPidMover` turns the decision's moves into protocol steps, and every tick it also advances the moves
in flight, serves `fluxjoin move` requests and recovers dead instances. `--dry-run` prints decisions
without executing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from controller.assignment import initial_assignment
from controller.moves import KafkaPidMover
from controller.rounds import PolicyRounds
from pipeline.config import Config


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
) -> None:
    """Run until `stop()`; publishes epoch 0 over `cfg.instances` instances if the log has none.

    `params` are the policy's (`controller.rounds.policy_params`), handoff mode included.
    """
    mover = KafkaPidMover(cfg, bootstrap, heartbeat_timeout_s, say=say)
    mover.start(initial_assignment(cfg.partitions, instance_names(cfg.instances)))
    rounds = PolicyRounds.begin(policy_name, params)
    last_reason = ""
    say(f"controller: policy {policy_name} {params}, heartbeat timeout {heartbeat_timeout_s:g} s")
    try:
        while not stop():
            mover.step()
            decision = rounds.tick(mover, dry_run=dry_run)
            if decision is not None:
                if rounds.last_snapshot is not None:
                    say(f"policy {policy_name} read {rounds.last_snapshot.describe()}")
                for move in decision.moves:
                    what = f"pid {move.pid} {move.source} -> {move.target}"
                    say(f"policy {policy_name}: {what} ({decision.reason})")
                if not decision.moves and decision.reason != last_reason:
                    say(f"policy {policy_name}: no move ({decision.reason})")
                last_reason = decision.reason
            mover.await_news()
    finally:
        mover.close()
