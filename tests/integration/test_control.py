"""The controller's view of the control log on a real broker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from controller.assignment import initial_assignment
from controller.moves.kafka_mover import KafkaPidMover, request_moves
from pipeline.config import Config, load_config
from pipeline.control import ControlLog, ControlLogTruncated, InstanceFollower, publish, wait_for
from pipeline.control_view import Message
from pipeline.instance_files import OwnedPids, read_assignment, write_assignment
from pipeline.protocol import AcquiredMsg, AssignmentMsg, Handoff, Mode, MoveSpec, ProtocolError, ReleasedMsg
from pipeline.protocol_codec import encode
from pipeline.topics import ensure_topics, partition_offsets


def _pipeline(topic_prefix: str, bootstrap: str) -> Config:
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=4", "instances=2"])
    ensure_topics(cfg, bootstrap)
    return cfg


def _publish_all(producer: Producer, topic: str, *messages: Message) -> None:
    for msg in messages:
        publish(producer, topic, msg)
    assert producer.flush(30) == 0


def _epochs(producer: Producer, topic: str, epochs: range) -> None:
    _publish_all(producer, topic, *(AssignmentMsg(epoch=e, owners={0: "i-0", 1: "i-1"}) for e in epochs))


def _truncate(bootstrap: str, topic: str, below: int) -> None:
    """What retention does to old segments: every record below `below` is gone."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_records([TopicPartition(topic, 0, below)]).values():
        fut.result()


def _end(bootstrap: str, topic: str) -> int:
    return partition_offsets(AdminClient({"bootstrap.servers": bootstrap}), [(topic, 0)])[(topic, 0)]


def test_the_controller_reads_its_own_assignment_while_an_instance_transaction_is_open(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """An instance's `Acquired` rides in the transaction of its results; while that transaction is open,
    a read-committed reader sees nothing appended after it. The controller must still see what it
    published itself, or it plans its next step (and reports the moves in flight) from the epoch before."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    handoff = Handoff(move_id="h-0", mode=Mode.REPLAY, cutoff={"A": 0, "B": 0})
    start = AssignmentMsg(epoch=0, owners={0: "i-0", 1: "i-0", 2: "i-1", 3: "i-1"}, handoffs={0: handoff})
    _publish_all(Producer({"bootstrap.servers": kafka_bootstrap}), cfg.control_topic, start)
    mover = KafkaPidMover(cfg, kafka_bootstrap, say=lambda line: None)
    followers = [
        InstanceFollower(cfg, kafka_bootstrap, name, "inc", tmp_path / f"{name}.json", mover.log)
        for name in ("i-0", "i-1")
    ]
    instance = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{topic_prefix}-i-0"})
    try:
        for follower in followers:
            follower.serving = True
            follower.heartbeat()
        wait_for(lambda: mover.ready_instances() == {"i-0", "i-1"}, timeout_s=30, what="both heartbeats")
        request_moves(cfg, kafka_bootstrap, [2], "i-0", Mode.TRANSFER)
        wait_for(lambda: bool(mover.log.catch_up().pending_requests()), timeout_s=30, what="the request")
        instance.init_transactions(30)
        instance.begin_transaction()
        ack = AcquiredMsg(instance="i-0", epoch=0, pid=0, move_id="h-0")
        instance.produce(cfg.control_topic, value=encode(ack), key=b"AcquiredMsg")
        assert instance.flush(30) == 0

        mover.step()
        current = mover.assignment()
        assert current is not None and current.epoch == 1, "the controller's own epoch 1"
        assert dict(current.owners) == {0: "i-0", 1: "i-0", 2: "i-0", 3: "i-1"}
        assert mover.log.catch_up().acquired == {}, "the open transaction is still not read"

        instance.commit_transaction(30)
        deadline = time.monotonic() + 30  # the broker writes the commit markers after it answers
        while "h-0" not in mover.log.catch_up().acquired:
            assert time.monotonic() < deadline, "the committed transaction never became readable"
            time.sleep(0.1)
        assert mover.assignment() == current, "reading its own assignment again changes nothing"
    finally:
        for follower in followers:
            follower.stop()
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


def test_the_control_topic_keeps_its_messages_forever(kafka_bootstrap: str, topic_prefix: str) -> None:
    """The control log is the protocol's only state: a broker's default retention (7 days) would delete
    the assignment of a pipeline that has not moved a pid for a week. Never compacted either: its keys
    are message types, so compaction would keep one assignment and one acknowledgement of all."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resource = ConfigResource(ConfigResource.Type.TOPIC, cfg.control_topic)
    configs = admin.describe_configs([resource])[resource].result()
    assert configs["retention.ms"].value == "-1"
    assert configs["cleanup.policy"].value == "delete"


def test_a_reader_of_a_log_truncated_past_every_snapshot_refuses_to_guess(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """With the first records gone and no snapshot after them, the retained tail is not the state: a
    fresh reader must say so, not return the tail (the controller would republish epoch 0 on it)."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    _epochs(producer, cfg.control_topic, range(4))
    _truncate(kafka_bootstrap, cfg.control_topic, below=2)
    fresh = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        with pytest.raises(ControlLogTruncated, match=f"{cfg.control_topic} .*offset 2"):
            fresh.catch_up(timeout_s=10)
    finally:
        fresh.close()


def test_a_reader_refuses_two_different_assignments_of_one_epoch(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    one, other = AssignmentMsg(epoch=0, owners={0: "i-0"}), AssignmentMsg(epoch=0, owners={0: "i-1"})
    _publish_all(producer, cfg.control_topic, one, other)
    reader = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        with pytest.raises(ProtocolError, match="epoch 0"):
            reader.catch_up(timeout_s=10)
    finally:
        reader.close()


def test_the_follower_never_writes_an_older_epoch_than_its_file(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The assignment file is what the instance's query acts on; going back to an older epoch would
    hand it pids it has released (read from the log start: duplicates)."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    _epochs(Producer({"bootstrap.servers": kafka_bootstrap}), cfg.control_topic, range(3))
    path = tmp_path / "assignment.json"
    write_assignment(path, OwnedPids(epoch=5, pids=frozenset({3})))
    log = ControlLog(kafka_bootstrap, cfg.control_topic)
    follower = InstanceFollower(cfg, kafka_bootstrap, "i-0", "inc-0", path, log)
    try:
        follower.sync()
        assert read_assignment(path).epoch == 5
    finally:
        follower.stop()
        log.close()


def test_a_follower_whose_incarnation_is_evicted_stops_its_instance(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """An instance frozen past the heartbeat timeout wakes evicted: its pids were recovered elsewhere. It
    must stop even when no batch of its would meet the sink's fence (it holds no pid, its query is
    idle). A "name@?" listed before this incarnation began is about an earlier one; listed later, it is
    about this one (a controller that never heard it declared it dead)."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    owners = {0: "i-1", 1: "i-1"}
    _publish_all(producer, cfg.control_topic, AssignmentMsg(epoch=0, owners=owners, evicted=("i-0@?",)))
    log = ControlLog(kafka_bootstrap, cfg.control_topic)
    follower = InstanceFollower(cfg, kafka_bootstrap, "i-0", "inc-1", tmp_path / "assignment.json", log)
    try:
        follower.sync()
        assert not follower.evicted.is_set(), "an eviction of an earlier incarnation"
        _publish_all(producer, cfg.control_topic, AssignmentMsg(epoch=1, owners=owners))
        follower.sync()
        assert not follower.evicted.is_set()
        _publish_all(
            producer, cfg.control_topic, AssignmentMsg(epoch=2, owners=owners, evicted=("i-0@inc-1",))
        )
        follower.sync()
        assert follower.evicted.is_set(), "its own incarnation evicted"
    finally:
        follower.stop()
        log.close()


MOVE = MoveSpec(move_id="m-7", pid=1, source="i-1", target="i-0", mode=Mode.REPLAY)


def test_a_fresh_reader_of_a_truncated_log_starts_from_a_snapshot(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Epochs 0..3, a move's release, then the controller's snapshot; the records before the snapshot
    deleted. A fresh reader sees epoch 3 and the release the move still needs, as if nothing were gone."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    _epochs(producer, cfg.control_topic, range(3))
    moving = AssignmentMsg(epoch=3, owners={0: "i-0"}, moving={1: MOVE})
    released = ReleasedMsg(instance="i-1", epoch=3, pid=1, move_id="m-7", cutoff={"A": 5, "B": 6})
    _publish_all(producer, cfg.control_topic, moving, released)
    writer = ControlLog(kafka_bootstrap, cfg.control_topic)
    fresh = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        writer.catch_up()
        writer.write_snapshot(producer)
        assert producer.flush(30) == 0
        _truncate(kafka_bootstrap, cfg.control_topic, below=_end(kafka_bootstrap, cfg.control_topic) - 1)
        view = fresh.catch_up(timeout_s=10)
        assert view.assignment == moving
        assert view.released == {"m-7": released}
    finally:
        writer.close()
        fresh.close()


def test_a_reader_overtaken_by_a_truncation_reads_on_from_a_snapshot(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """A reader that was at epoch 0 when the log was truncated past it must not skip to what is left
    (librdkafka would reset it to the log start silently): it takes the state from a snapshot, and
    without one it refuses."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    _epochs(producer, cfg.control_topic, range(1))
    behind = ControlLog(kafka_bootstrap, cfg.control_topic)
    writer = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        assert behind.catch_up().assignment is not None
        _epochs(producer, cfg.control_topic, range(1, 4))
        assert writer.catch_up().assignment is not None, "the controller has read every record"
        _truncate(kafka_bootstrap, cfg.control_topic, below=3)
        with pytest.raises(ControlLogTruncated, match="offset 3"):
            behind.catch_up(timeout_s=10)
        moving = AssignmentMsg(epoch=4, owners={0: "i-0"}, moving={1: MOVE})
        released = ReleasedMsg(instance="i-1", epoch=4, pid=1, move_id="m-7", cutoff={"A": 5, "B": 6})
        _publish_all(producer, cfg.control_topic, moving, released)
        writer.catch_up()
        writer.write_snapshot(producer)
        assert producer.flush(30) == 0
        _truncate(kafka_bootstrap, cfg.control_topic, below=_end(kafka_bootstrap, cfg.control_topic) - 1)
        view = behind.catch_up(timeout_s=10)
        assert view.assignment == moving and view.released == {"m-7": released}
    finally:
        behind.close()
        writer.close()


def test_a_snapshot_that_missed_records_now_deleted_is_not_trusted(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """A snapshot holds what its writer had read: records it had not read yet (an instance's transaction
    still open, or just not fetched) lie below it in the log. Deleted, they are in neither the snapshot
    nor what is left, and the view from them would miss them (here epochs 2 and 3)."""
    cfg = _pipeline(topic_prefix, kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    _epochs(producer, cfg.control_topic, range(2))
    writer = ControlLog(kafka_bootstrap, cfg.control_topic)
    fresh = ControlLog(kafka_bootstrap, cfg.control_topic)
    try:
        writer.catch_up()
        _epochs(producer, cfg.control_topic, range(2, 4))
        writer.write_snapshot(producer)
        assert producer.flush(30) == 0
        _truncate(kafka_bootstrap, cfg.control_topic, below=_end(kafka_bootstrap, cfg.control_topic) - 1)
        with pytest.raises(ControlLogTruncated, match="offset 4"):
            fresh.catch_up(timeout_s=10)
    finally:
        writer.close()
        fresh.close()
