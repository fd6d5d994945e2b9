"""The exactly-once sink against the other writers of its topics, on a real broker: transactions other
processes leave open, an eviction published while its batch is in flight, its `transactional.id` taken
over, a broker that does not take a snapshot in time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from pipeline.commits import last_commit, newest_markers
from pipeline.config import Config, load_config
from pipeline.control import ControlLog, InstanceFollower
from pipeline.instance import QueryProgress
from pipeline.operator import KIND_RELEASED, KIND_STATE
from pipeline.protocol import AcquiredMsg, AssignmentMsg, CommitMarker
from pipeline.protocol_codec import encode, marker_to_json
from pipeline.sink import TRANSACTION_TIMEOUT_S, ExactlyOnceSink, Fenced
from pipeline.topics import ensure_topics, read_topic
from tests.conftest import Broker


def _marker(instance: str, incarnation: str, batch: int) -> str:
    marker = CommitMarker(
        instance=instance, incarnation=incarnation, batch=batch, epoch=0, offsets={}, time_ms=0
    )
    return json.dumps(marker_to_json(marker))


def _config(prefix: str) -> Config:
    return load_config(None, [f"pipeline={prefix}", "streams=[A, B]", "partitions=4", "instances=2"])


def _sink(
    cfg: Config, bootstrap: str, work: Path, instance: str = "i", incarnation: str = "inc"
) -> ExactlyOnceSink:
    ensure_topics(cfg, bootstrap)
    work.mkdir(parents=True, exist_ok=True)
    return ExactlyOnceSink(
        cfg,
        bootstrap,
        instance,
        incarnation,
        work / "checkpoint",
        work / "watermarks.json",
        work / "recent_yields.json",
    )


class _Batch:
    """What `foreachBatch` hands the sink: a micro-batch it collects as Arrow."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table

    def toArrow(self) -> pa.Table:
        return self.table


def _empty_batch(sink: ExactlyOnceSink, batch_id: int, epoch: int = 0) -> _Batch:
    """A batch of pid 0 that made no rows, with the offsets Spark would have logged for it."""
    offsets = {"epoch": epoch, "offsets": {s: {"0": 0} for s in sink.streams}}
    log = sink.checkpoint / "offsets"
    log.mkdir(parents=True, exist_ok=True)
    (log / str(batch_id)).write_text("v1\n{}\n" + json.dumps(offsets) + "\n")
    columns: dict[str, Any] = {
        "kind": np.empty(0, np.int8),
        "pid": np.empty(0, np.int32),
        "key": np.empty(0, np.int64),
        "ts": np.empty(0, np.int64),
        "aux": np.empty(0, np.int64),
        **{f"id{j}": np.empty(0, np.int64) for j in range(len(sink.streams))},
        "payload": pa.array([], pa.binary()),
    }
    return _Batch(pa.table(columns))


def _transactional(bootstrap: str, transactional_id: str, **extra: Any) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id, **extra})
    producer.init_transactions(30)
    return producer


def test_a_restarting_sink_finds_its_newest_marker_behind_another_instances_open_transaction(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """Read committed, a reader sees nothing past the first message of a transaction still open. A marker
    committed after another instance's open marker must still count, or the restarted instance produces
    its newest batch again; the open marker counts only once it commits, never when it aborts."""
    cfg = _config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    other = _transactional(kafka_bootstrap, f"{topic_prefix}.y", **{"transaction.timeout.ms": 2000})
    other.begin_transaction()
    other.produce(cfg.sink_commits_topic, key="y", value=_marker("y", "j", 3))
    assert other.flush(30) == 0
    restarted = _transactional(kafka_bootstrap, f"{topic_prefix}.x")
    restarted.begin_transaction()
    restarted.produce(cfg.sink_commits_topic, key="x", value=_marker("x", "i", 7))
    restarted.commit_transaction(30)

    newest = last_commit(cfg, kafka_bootstrap, "x", "i")
    assert newest is not None and newest.batch == 7
    assert "y" not in newest_markers(cfg, kafka_bootstrap), "the broker aborted y's transaction"


def test_the_fence_check_sees_an_eviction_behind_the_batchs_own_acknowledgement(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A batch's `Acquired` is in its own open transaction, and another instance's may be open too: an
    eviction published after them must still stop the batch from committing."""
    cfg = _config(topic_prefix)
    sink = _sink(cfg, kafka_bootstrap, tmp_path)
    other = _transactional(kafka_bootstrap, f"{topic_prefix}.other")
    controller = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        other.begin_transaction()
        ack = AcquiredMsg(instance="other", epoch=0, pid=1, move_id="m-1")
        other.produce(cfg.control_topic, value=encode(ack), key="AcquiredMsg")
        assert other.flush(30) == 0
        sink.producer.begin_transaction()
        ack = AcquiredMsg(instance="i", epoch=0, pid=0, move_id="m-0")
        sink.producer.produce(cfg.control_topic, value=encode(ack), key="AcquiredMsg")
        assert sink.producer.flush(30) == 0
        evicting = AssignmentMsg(epoch=1, owners={p: "other" for p in range(4)}, evicted=("i@inc",))
        controller.produce(cfg.control_topic, value=encode(evicting), key="AssignmentMsg")
        assert controller.flush(30) == 0

        assert sink._evicted_in({"epoch": 0}) == 1
    finally:
        sink.producer.abort_transaction(30)
        other.abort_transaction(30)
        sink.close()


@pytest.mark.parametrize("when", ["between batches", "in the batch's transaction"])
def test_a_sink_whose_transactional_id_is_taken_over_stops_as_evicted(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path, when: str
) -> None:
    """The controller fences a dead instance by initialising its `transactional.id`: the instance's sink,
    should it go on, must neither commit nor crash and restart as though nothing happened, but stop as
    evicted (`Fenced`: the instance exits with the eviction status)."""
    cfg = _config(topic_prefix)
    sink = _sink(cfg, kafka_bootstrap, tmp_path)
    sink(_empty_batch(sink, 0), 0)

    def fence() -> None:
        _transactional(kafka_bootstrap, f"{cfg.pipeline}.i")

    if when == "between batches":
        fence()
    else:
        check = sink._evicted_in

        def fenced_meanwhile(offsets: dict[str, Any]) -> int | None:
            fence()
            return check(offsets)

        sink._evicted_in = fenced_meanwhile  # type: ignore[method-assign]
    with pytest.raises(Fenced):
        sink(_empty_batch(sink, 1), 1)
    newest = last_commit(cfg, kafka_bootstrap, "i", "inc")
    assert newest is not None and newest.batch == 0, "batch 1 never committed"


def test_a_heartbeat_says_how_far_the_query_has_got(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A heartbeat proves the control follower lives; the query's progress beside it lets the controller
    tell an instance whose query is stuck from one that works or has nothing to do."""
    cfg = _config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    log = ControlLog(kafka_bootstrap, cfg.control_topic)
    follower = InstanceFollower(cfg, kafka_bootstrap, "i", "inc", tmp_path / "assignment.json", log)
    try:
        follower.progress = QueryProgress(progress_ms=1_234, batch=5).fields()
        follower.heartbeat()
        follower.stop()
        beats = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.metrics_topic)]
    finally:
        log.close()
    assert [(b["kind"], b["batch"], b["progress_ms"]) for b in beats] == [("heartbeat", 5, 1_234)]


def test_a_produce_phase_longer_than_the_transaction_timeout_fails_saying_so(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker aborts a transaction open for longer than its timeout, and the producer then reads as
    fenced: the batch must fail naming its produce phase's length, not as an eviction."""
    import pipeline.sink

    monkeypatch.setattr(pipeline.sink, "TRANSACTION_TIMEOUT_S", 1.0)
    cfg = _config(topic_prefix)
    sink = _sink(cfg, kafka_bootstrap, tmp_path)
    check = sink._evicted_in
    metrics = TopicPartition(cfg.metrics_topic, 0)
    ends = {
        level: Consumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": "unused", "isolation.level": level}
        )
        for level in ("read_committed", "read_uncommitted")
    }

    def after_the_broker_aborted(offsets: dict[str, Any]) -> int | None:
        assert sink.producer.flush(30) == 0
        # The batch's metrics hold the partition's last stable offset below its end until the broker
        # aborts the transaction.
        while len({c.get_watermark_offsets(metrics, timeout=30)[1] for c in ends.values()}) > 1:
            time.sleep(0.2)
        return check(offsets)

    sink._evicted_in = after_the_broker_aborted  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="transaction timeout") as failed:
        sink(_empty_batch(sink, 0), 0)
    assert not isinstance(failed.value, Fenced)
    assert last_commit(cfg, kafka_bootstrap, "i", "inc") is None


def test_a_snapshot_the_broker_does_not_take_in_time_fails_the_attempt_for_another(
    own_broker: Broker, topic_prefix: str, tmp_path: Path
) -> None:
    """A released window's chunks must all be in the transaction before `Released` names their offsets:
    when the broker does not take them while the transaction lasts, the attempt fails as one to abort
    and produce again (decision 0048), not with an error that ends the instance."""
    cfg = _config(topic_prefix)
    sink = _sink(cfg, own_broker.bootstrap, tmp_path)
    kind = np.array([KIND_STATE, KIND_RELEASED], np.int8)
    columns: dict[str, np.ndarray] = {
        "kind": kind,
        "pid": np.array([2, 2], np.int32),
        "key": np.array([11, 0], np.int64),
        "ts": np.array([1000, 0], np.int64),
        "aux": np.array([0, 0], np.int64),
        "id0": np.array([5, 1000], np.int64),
        "id1": np.array([0, 1000], np.int64),
    }
    broker = own_broker.container
    sink.producer.begin_transaction()
    broker.pause()
    try:
        with pytest.raises(KafkaException) as failed:
            sink.output.export(2, columns, kind, time.monotonic() + TRANSACTION_TIMEOUT_S)
    finally:
        broker.unpause()
    error = failed.value.args[0]
    assert error.txn_requires_abort(), error
    assert "not delivered" in error.str()
