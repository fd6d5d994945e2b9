"""What a sink's commits leave to read back: the commit markers in the `sink-commits` topic, the
offsets Spark logged for a batch, the `transactional.id` that fences an instance, and the evictions in
the control log.

The sink (`pipeline.sink`) writes each batch's commit marker in the batch's own transaction, so the
newest committed marker of an instance says which of its batches reached Kafka: the sink reads it at
start to skip those batches, the controller to judge progress and recovery (`controller.moves`), the
laptop runtime to measure its backlog (`local.processes`). Those readers own no sink, which is why the
reading lives apart from the transaction. `Evictions` reads the control log for what a sink must know
before each commit, whether its instance was declared dead since: a reader, like the others, and no
part of the transaction it guards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from pipeline.config import Config
from pipeline.control import StuckFetch
from pipeline.control_view import SnapshotMsg
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.protocol import AssignmentMsg, CommitMarker, ProtocolError
from pipeline.protocol_codec import decode, marker_author, marker_from_json
from pipeline.topics import BOUNDED_READ, partition_offsets, read_topic


def read_logged_offsets(checkpoint: Path, batch_id: int) -> dict[str, Any]:
    """The source offset Spark logged for `batch_id` (the offset log is written before the batch runs)."""
    lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
    return dict(json.loads(lines[-1]))


def newest_markers(cfg: Config, bootstrap: str) -> dict[str, CommitMarker]:
    """Each instance's newest marker committed before the call, by instance name. Read to the high
    watermark once the transactions below it have ended: read only to the last stable offset, another
    instance's open transaction hides every marker committed after its first message."""
    newest: dict[str, CommitMarker] = {}
    for _, _, value in read_topic(bootstrap, cfg.sink_commits_topic, settled=True, signed_by=marker_author):
        marker = marker_from_json(json.loads(value))
        newest[marker.instance] = marker
    return newest


def transactional_id(cfg: Config, instance: str) -> str:
    """The `transactional.id` of `instance`'s sink: initialising it fences the instance."""
    return f"{cfg.pipeline}.{instance}"


def last_commit(cfg: Config, bootstrap: str, instance: str, incarnation: str) -> CommitMarker | None:
    """The newest committed marker of this incarnation of `instance` (a checkpoint's life); an older
    incarnation's markers all precede the first of a newer one, so the instance's newest marker decides."""
    marker = newest_markers(cfg, bootstrap).get(instance)
    return marker if marker is not None and marker.incarnation == incarnation else None


class Evictions:
    """The newest epoch whose assignment lists one of `names` as evicted, read from the control log to its
    high watermark, uncommitted assignments included.

    Read committed, the log ends at its last stable offset, before a batch's own acknowledgements (they
    are in its open transaction) and before any other open transaction's: an eviction published after
    them would be invisible until they end. Assignments are all that is read here, and reading one
    before it commits errs on the safe side: an eviction in a transaction that then aborts stops a live
    instance, which restarts from its checkpoint."""

    def __init__(self, bootstrap: str, topic: str, names: frozenset[str], admin: Any) -> None:
        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_uncommitted",
                "auto.offset.reset": "earliest",
            }
            | BOUNDED_READ
        )
        self._consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self._topic, self._names, self._admin = topic, names, admin
        self._next = 0
        self.newest: int | None = None

    def catch_up(self, timeout_s: float = 30.0) -> int | None:
        """Read every message appended before this call; the newest epoch that evicts `names`."""
        end = partition_offsets(self._admin, [(self._topic, 0)], timeout_s=timeout_s)[(self._topic, 0)]
        deadline = time.monotonic() + timeout_s
        stuck = StuckFetch(self._consumer, self._topic, self._next)
        while self._next < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._topic} not readable up to offset {end}")
            stuck.check(self._next)
            for msg in self._consumer.consume(num_messages=1000, timeout=0.1):
                if msg.error() is not None:
                    continue
                self._next = (msg.offset() or 0) + 1
                self._note(msg.value() or b"")
            position = self._consumer.position([TopicPartition(self._topic, 0)])[0].offset
            self._next = max(self._next, position)  # past transaction markers, which are not delivered
        return self.newest

    def _note(self, raw: bytes) -> None:
        try:
            msg = decode(raw)
        except ProtocolError:
            return
        # A snapshot stands for the assignments before it, which the log may no longer hold.
        assignment = msg.view.assignment if isinstance(msg, SnapshotMsg) else msg
        if isinstance(assignment, AssignmentMsg) and self._names & set(assignment.evicted):
            epoch = assignment.epoch
            self.newest = max(epoch, self.newest if self.newest is not None else epoch)

    def close(self) -> None:
        self._consumer.close()
