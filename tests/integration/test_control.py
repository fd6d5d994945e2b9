"""The controller's view of the control log on a real broker."""

from __future__ import annotations

import json
import time
from pathlib import Path

from confluent_kafka import Producer

from controller.assignment import initial_assignment
from controller.moves import KafkaPidMover
from pipeline.config import load_config
from pipeline.control import InstanceFollower, wait_for
from pipeline.protocol import AcquiredMsg, encode


def test_the_controller_reads_its_own_assignment_while_an_instance_transaction_is_open(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """An instance's `Acquired` rides in the transaction of its results; while that transaction is open,
    a read-committed reader sees nothing appended after it. The controller must still see what it
    published itself, or it plans its next step (and reports the moves in flight) from the epoch before."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=4", "instances=2"])
    mover = KafkaPidMover(cfg, kafka_bootstrap, say=lambda line: None)
    instance = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic_prefix}-i-0"})
    try:
        instance.init_transactions(30)
        instance.begin_transaction()
        ack = AcquiredMsg(instance="i-0", epoch=0, pid=0, move_id="none")
        instance.produce(cfg.control_topic, value=encode(ack), key=b"AcquiredMsg")
        assert instance.flush(30) == 0

        mover.start(initial_assignment(4, ["i-0", "i-1"]))
        current = mover.assignment()
        assert current is not None and current.epoch == 0, "the controller's own epoch 0"
        assert dict(current.owners) == {0: "i-0", 1: "i-0", 2: "i-1", 3: "i-1"}
        assert mover.log.catch_up().acquired == {}, "the open transaction is still not read"

        instance.commit_transaction(30)
        deadline = time.monotonic() + 30  # the broker writes the commit markers after it answers
        while "none" not in mover.log.catch_up().acquired:
            assert time.monotonic() < deadline, "the committed transaction never became readable"
            time.sleep(0.1)
        assert mover.assignment() == current, "reading its own assignment again changes nothing"
    finally:
        mover.close()


def test_an_instance_is_ready_to_take_pids_once_its_query_serves(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Heartbeats start before Spark does (a restarting instance must not look dead), but pids moved
    onto an instance whose query has not run a batch would pause until it had: only a serving instance
    is ready. A heartbeat that says nothing of serving (an older instance) counts as serving."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=4", "instances=2"])
    mover = KafkaPidMover(cfg, kafka_bootstrap, say=lambda line: None)
    follower = InstanceFollower(cfg, kafka_bootstrap, "i-1", "inc-1", tmp_path / "a.json", mover.log)
    older = Producer({"bootstrap.servers": kafka_bootstrap})
    beat = {
        "kind": "heartbeat",
        "instance": "i-0",
        "incarnation": "inc-0",
        "time_ms": int(time.time() * 1000),
    }
    older.produce(cfg.metrics_topic, key=b"i-0", value=json.dumps(beat))
    assert older.flush(30) == 0

    def live() -> set[str]:
        mover.observer.poll(0.1)
        return set(mover.observer.liveness().live)

    try:
        follower.heartbeat()
        wait_for(lambda: live() == {"i-0", "i-1"}, timeout_s=30, what="both heartbeats")
        assert mover.ready_instances() == {"i-0"}, "live but not serving yet: not ready"
        mover.start(initial_assignment(cfg.partitions, ["i-0", "i-1"]))
        snapshot = mover.snapshot(interval_s=4.0, now_s=time.monotonic(), last_adaptation_s=None)
        assert snapshot is not None
        assert [s.instance for s in snapshot.instances] == ["i-0"], "a policy sees only ready instances"
        follower.serving = True
        follower.heartbeat()
        wait_for(
            lambda: mover.ready_instances() == {"i-0", "i-1"}, timeout_s=30, what="its serving heartbeat"
        )
    finally:
        follower.stop()
        older.flush(5)
        mover.close()
