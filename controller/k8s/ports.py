"""The port through which the operator has pid moves carried out: the `PidMover` protocol, and the
production mover on a pipeline's Kafka control topic (`make_mover`).

Apart from the reconciler so that the reconciler depends on the protocol only, and the tests give it
movers of their own; the Kafka side is imported only when a production mover is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from controller.assignment import Assignment, FinishedMove, Move
from controller.k8s.spec import PipelineSpec
from controller.policies.base import InstanceStats, Snapshot

log = logging.getLogger(__name__)


class PidMover(Protocol):
    """Carries out pid moves for one pipeline (the Kafka control-topic protocol in production).

    After `start` returns, `assignment()` returns the published assignment (or a later one); after
    `request` returns, `in_flight()` lists the requested moves until each completes, and a completed move
    shows in `assignment()` at the next epoch. The operator relies on both to stay idempotent.
    """

    def assignment(self) -> Assignment | None:
        """The assignment of record, None before the first."""
        ...

    def start(self, initial: Assignment) -> None:
        """Publish the first assignment (epoch 0)."""
        ...

    def request(self, moves: Sequence[Move]) -> None:
        """Ask for moves; idempotent for moves already in flight."""
        ...

    def gate_spills(self, spill: bool) -> None:
        """Tell the instances whether to spill at their threshold (`Decision.spill`)."""
        ...

    def in_flight(self) -> Sequence[Move]:
        """Moves requested and not yet complete."""
        ...

    def releasing(self) -> Sequence[Move]:
        """Moves of `in_flight()` whose pid its source has not released yet."""
        ...

    def finished(self) -> Sequence[FinishedMove]:
        """Moves that left `in_flight()` since the last call, each returned once."""
        ...

    def ready_instances(self) -> set[str]:
        """Instances that heartbeat and whose query has run a batch: ready to take pids."""
        ...

    def pods(self, ready: Collection[str] | None, restarting: Collection[str], grace_s: float) -> None:
        """What Kubernetes says of the wanted instance pods: only `ready` ones may take pids (None: no
        pod is seen, heartbeats alone decide); the `restarting` ones may be silent up to `grace_s`
        before they are dead."""
        ...

    def instance_stats(self) -> Mapping[str, InstanceStats]:
        """The latest statistics per instance id (for status); instances that reported nothing are absent."""
        ...

    def step(self) -> object:
        """Advance the moves in flight (called every round before the mover's state is read, and
        between rounds while moves are in flight)."""
        ...

    def await_news(self) -> bool:
        """Wait briefly (at most a tenth of a second) for the pipeline's next control message."""
        ...

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        """The pipeline's statistics of the last `interval_s` seconds for the policy, None before epoch 0."""
        ...

    def close(self) -> None:
        """Release the mover's connections when the operator drops it."""
        ...


MoverFactory = Callable[[PipelineSpec], PidMover]


def make_mover(spec: PipelineSpec) -> PidMover:
    """The production mover for one pipeline: `controller.moves.kafka_mover.KafkaPidMover` on its
    control topic."""

    def say(line: str) -> None:
        log.info("%s/%s: %s", spec.namespace, spec.name, line)

    from controller.moves.kafka_mover import KafkaPidMover

    return KafkaPidMover(
        spec.to_config(), spec.bootstrap_servers, heartbeat_timeout_s=spec.heartbeat_timeout_s, say=say
    )
