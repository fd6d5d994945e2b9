"""The generator against a real broker: what lands in the input topics, and topic checks."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic

from generator.producer import ID_SCAN_MESSAGES, run_generator
from pipeline.codec import decode_tuples, progress_of
from pipeline.config import Config, load_config
from pipeline.partitioning import pids_of
from pipeline.topics import (
    COMMITS_SEGMENT_MS,
    BrokerUnreachable,
    TopicError,
    admin_client,
    check_reachable,
    delete_topics,
    ensure_topics,
    partition_offsets,
    topic_specs,
    topics_named_after,
)
from tests.conftest import Broker

pytestmark = pytest.mark.integration

PARTITIONS = 8


def gen_config(pipeline: str, *extra: str) -> Config:
    return load_config(
        None,
        [
            f"pipeline={pipeline}",
            f"partitions={PARTITIONS}",
            "instances=2",
            "generator.mode=max_rate",
            "generator.duration_s=null",
            "generator.max_tuples=20000",
            "generator.rate={kind: toggle, low: 2000, high: 8000, period_s: 0.4}",
            "generator.keys={kind: zipf, count: 5000, s: 1.1}",
            "generator.tuples_per_message=64",
            "generator.payload_bytes=10",
            *extra,
        ],
    )


@dataclass
class Message:
    partition: int
    key: bytes | None
    timestamp_ms: int
    value: bytes

    @property
    def progress(self) -> int | None:
        """The event time of a progress record, None for tuples."""
        return progress_of(self.value)


def read_all(bootstrap: str, topic: str, partitions: int) -> list[Message]:
    """Every committed message of `topic`, as the instances read it (read_committed): each partition up
    to its end (end-of-partition, which lies past the last transaction's marker), then again those whose
    ends still move. A fresh look at the ends after reaching them makes the read complete even if the
    first look raced the broker's last acknowledged append."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "unused",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    admin = admin_client(bootstrap)

    def ends() -> dict[int, int]:
        found = partition_offsets(admin, [(topic, p) for p in range(partitions)], committed=True)
        return {p: found[(topic, p)] for p in range(partitions)}

    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out: list[Message] = []
        deadline = time.monotonic() + 60
        seen: dict[int, int] = {}
        while True:
            # a partition reports its end once per arrival there: wait only on those whose end moved
            latest = ends()
            pending = {p for p in range(partitions) if latest[p] != seen.get(p)}
            if not pending:
                return out
            seen = latest
            while pending:
                assert time.monotonic() < deadline, f"timed out reading {topic}"
                for msg in consumer.consume(1000, timeout=0.1):
                    partition, value, err = msg.partition(), msg.value(), msg.error()
                    assert partition is not None
                    if err is not None:
                        assert err.code() == KafkaError._PARTITION_EOF, err
                        pending.discard(partition)
                        continue
                    assert value is not None
                    out.append(Message(partition, msg.key(), msg.timestamp()[1], value))
    finally:
        consumer.close()


def test_generated_tuples_land_in_their_pid_partitions(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(topic_prefix)
    stats = run_generator(cfg, kafka_bootstrap)
    assert stats["tuples"] == 20_000
    assert sum(stats["per_stream"].values()) == 20_000
    assert set(stats["per_stream"]) == {"A", "B", "C"}
    assert stats["id_base"] == {"A": 0, "B": 0, "C": 0}
    assert stats["late_injected"] == 0
    messages = progress = 0
    for stream in cfg.streams:
        ids, event_times = [], []
        for msg in read_all(kafka_bootstrap, cfg.input_topic(stream), PARTITIONS):
            messages += 1
            assert msg.key == str(msg.partition).encode()
            if msg.progress is not None:
                assert msg.timestamp_ms == msg.progress
                progress += 1
                continue
            batch = decode_tuples(msg.value)
            assert 0 < len(batch) <= 64
            assert batch.payload.shape[1] == 10
            assert (pids_of(batch.keys, PARTITIONS) == msg.partition).all()
            ids.append(batch.ids)
            event_times.append(batch.event_times)
        all_ids = np.concatenate(ids)
        assert len(all_ids) == stats["per_stream"][stream]
        assert len(np.unique(all_ids)) == len(all_ids), f"duplicate ids in stream {stream}"
        np.testing.assert_array_equal(np.sort(all_ids), np.arange(len(all_ids)))
        times = np.concatenate(event_times)
        assert times.min() >= stats["start_ms"]
    assert messages == stats["messages"]
    assert progress == stats["progress_records"]


def test_real_time_event_time_tracks_produce_time(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=1.5",
        "generator.max_tuples=null",
        "streams=[A, B]",
    )
    started = time.monotonic()
    stats = run_generator(cfg, kafka_bootstrap)
    ended_ms = time.time() * 1000
    assert time.monotonic() - started == pytest.approx(1.5, abs=1.0)
    # 1.5 s of a toggle averaging 5000/s per stream.
    assert stats["per_stream"]["A"] == pytest.approx(7500, rel=0.2)
    newest = []
    for msg in read_all(kafka_bootstrap, cfg.input_topic("A"), PARTITIONS):
        if msg.progress is not None:
            continue
        batch = decode_tuples(msg.value)
        # The message timestamp is its first event time (the replay handoff seeks by it).
        assert msg.timestamp_ms == int(batch.event_times.min())
        newest.append(int(batch.event_times.max()))
    # Event time is wall-clock arrival time: within the run, never in the future.
    assert stats["start_ms"] <= min(newest) and max(newest) <= ended_ms
    assert max(newest) - stats["start_ms"] == pytest.approx(1500, abs=200)


def test_real_time_and_max_rate_carry_the_same_tuples(kafka_bootstrap: str, topic_prefix: str) -> None:
    common = ("generator.duration_s=1.0", "generator.max_tuples=null", "streams=[A, B]")
    rt = gen_config(f"{topic_prefix}-rt", "generator.mode=real_time", *common)
    mr = gen_config(f"{topic_prefix}-mr", "generator.mode=max_rate", *common)
    rt_stats, mr_stats = run_generator(rt, kafka_bootstrap), run_generator(mr, kafka_bootstrap)
    assert rt_stats["per_stream"] == mr_stats["per_stream"]
    produced_b = rt_stats["per_stream"]["B"]

    def tuples(cfg: Config, start_ms: int) -> np.ndarray:
        rows = []
        for msg in read_all(kafka_bootstrap, cfg.input_topic("B"), PARTITIONS):
            if msg.progress is not None:
                continue
            b = decode_tuples(msg.value)
            rows.append(np.column_stack([b.ids, b.keys, b.event_times - start_ms, b.payload]))
        table = np.concatenate(rows)
        assert len(table) == produced_b, f"{cfg.pipeline}: read {len(table)} of {produced_b} tuples"
        return table[np.argsort(table[:, 0])]

    np.testing.assert_array_equal(tuples(rt, rt_stats["start_ms"]), tuples(mr, mr_stats["start_ms"]))


def late_by_the_rule(messages: list[Message], lateness_ms: int) -> list[int]:
    """Decision 0047 from a topic alone: per partition in offset order, the ids of the tuples below the
    largest event time of the tuples and progress records before them, minus the lateness."""
    late: list[int] = []
    largest: dict[int, int] = {}
    for msg in messages:  # read_all keeps each partition's offset order
        p = msg.partition
        if msg.progress is not None:
            largest[p] = max(largest.get(p, msg.progress), msg.progress)
            continue
        batch = decode_tuples(msg.value)
        for tuple_id, event_time in zip(batch.ids.tolist(), batch.event_times.tolist(), strict=True):
            if p in largest and event_time < largest[p] - lateness_ms:
                late.append(tuple_id)
            largest[p] = max(largest.get(p, event_time), event_time)
    return late


def tuple_ids(messages: list[Message]) -> np.ndarray:
    return np.concatenate([decode_tuples(m.value).ids for m in messages if m.progress is None])


def test_runs_on_one_pipeline_give_disjoint_ids(kafka_bootstrap: str, topic_prefix: str) -> None:
    # The first run's stream A goes silent on every pid early: each A partition ends in a long run of
    # progress records (20 ms apart over a real-time second), more than the first look back reads.
    every_pid = list(range(PARTITIONS))
    first = gen_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=1.5",
        "generator.max_tuples=null",
        "generator.progress_interval_ms=20",
        f"generator.silences=[{{stream: A, pids: {every_pid}, from_s: 0.3, to_s: 100}}]",
    )
    stats1 = run_generator(first, kafka_bootstrap)
    assert stats1["id_base"] == {"A": 0, "B": 0, "C": 0}
    before = {s: read_all(kafka_bootstrap, first.input_topic(s), PARTITIONS) for s in first.streams}
    trailing = [0] * PARTITIONS
    for msg in before["A"]:
        trailing[msg.partition] = trailing[msg.partition] + 1 if msg.progress is not None else 0
    assert min(trailing) > ID_SCAN_MESSAGES
    second = gen_config(topic_prefix, "generator.max_tuples=3000")
    stats2 = run_generator(second, kafka_bootstrap)
    for stream in first.streams:
        old = tuple_ids(before[stream])
        assert stats2["id_base"][stream] == old.max() + 1
        every = tuple_ids(read_all(kafka_bootstrap, second.input_topic(stream), PARTITIONS))
        assert len(every) == len(old) + stats2["per_stream"][stream]
        assert len(np.unique(every)) == len(every), f"stream {stream}: an id used by both runs"
        new = np.setdiff1d(every, old)
        assert new.min() == stats2["id_base"][stream]


def test_late_tuples_are_exactly_the_late_input(kafka_bootstrap: str, topic_prefix: str) -> None:
    n = 12
    cfg = gen_config(topic_prefix, f"generator.late_tuples={n}", "allowed_lateness_ms=50")
    stats = run_generator(cfg, kafka_bootstrap)
    assert stats["late_injected"] == n
    assert stats["tuples"] == 20_000 + n
    late = {
        stream: late_by_the_rule(read_all(kafka_bootstrap, cfg.input_topic(stream), PARTITIONS), 50)
        for stream in cfg.streams
    }
    assert {s: len(ids) for s, ids in late.items()} == {"A": 4, "B": 4, "C": 4}
    # Without injection, nothing is late: the generator writes each partition in event-time order.
    plain = gen_config(f"{topic_prefix}-plain", "allowed_lateness_ms=0")
    run_generator(plain, kafka_bootstrap)
    for stream in plain.streams:
        assert late_by_the_rule(read_all(kafka_bootstrap, plain.input_topic(stream), PARTITIONS), 0) == []


def test_a_silence_leaves_progress_records_only(kafka_bootstrap: str, topic_prefix: str) -> None:
    silent = [2, 5]
    cfg = gen_config(
        topic_prefix,
        "generator.progress_interval_ms=100",
        f"generator.silences=[{{stream: B, pids: {silent}, from_s: 0.1, to_s: 1.2}}]",
    )
    stats = run_generator(cfg, kafka_bootstrap)
    assert stats["tuples"] == 20_000
    start = stats["start_ms"]
    for stream in cfg.streams:
        in_span: dict[int, int] = {}
        outside: dict[int, int] = {}
        progress: dict[int, list[int]] = {}
        for msg in read_all(kafka_bootstrap, cfg.input_topic(stream), PARTITIONS):
            if msg.progress is not None:
                progress.setdefault(msg.partition, []).append(msg.progress - start)
                continue
            offsets = decode_tuples(msg.value).event_times - start
            span = (offsets >= 100) & (offsets < 1200)
            in_span[msg.partition] = in_span.get(msg.partition, 0) + int(span.sum())
            outside[msg.partition] = outside.get(msg.partition, 0) + int((~span).sum())
        for pid in range(PARTITIONS):
            if stream == "B" and pid in silent:
                assert in_span.get(pid, 0) == 0
                assert outside[pid] > 0
                assert any(100 < t <= 1200 for t in progress[pid]), progress
            else:
                assert in_span[pid] > 0


def test_a_lagged_stream_is_produced_behind_and_whole(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=1.0",
        "generator.max_tuples=null",
        "streams=[A, B]",
        "generator.stream_lag_ms={B: 1500}",
    )
    seen_b: list[int] = []

    def b_so_far() -> None:
        # Half a second into the run (event time 0.5 s), B's messages are still held back.
        time.sleep(0.5)
        ends = partition_offsets(
            admin_client(kafka_bootstrap), [(cfg.input_topic("B"), p) for p in range(PARTITIONS)]
        )
        seen_b.append(sum(ends.values()))

    probe = threading.Thread(target=b_so_far)
    started = time.monotonic()
    ensure_topics(cfg, kafka_bootstrap)
    probe.start()
    stats = run_generator(cfg, kafka_bootstrap)
    probe.join()
    # B's last messages are due 1.5 s after the run's last event time.
    assert time.monotonic() - started >= 2.4
    assert seen_b == [0]
    for stream in ("A", "B"):
        messages = read_all(kafka_bootstrap, cfg.input_topic(stream), PARTITIONS)
        assert len(tuple_ids(messages)) == stats["per_stream"][stream]


def test_stop_event_ends_a_run_early(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(
        topic_prefix, "generator.mode=real_time", "generator.duration_s=600", "generator.max_tuples=null"
    )
    stop = threading.Event()
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    started = time.monotonic()
    stats = run_generator(cfg, kafka_bootstrap, stop=stop)
    timer.cancel()
    assert time.monotonic() - started < 10
    assert stats["tuples"] > 0


def test_a_broker_silent_again_and_again_leaves_each_tuple_in_the_input_once(
    own_broker: Broker, topic_prefix: str
) -> None:
    """The broker's container is paused for 12 s three times while the generator writes in real time.
    Requests the broker took but never answered are sent again; an idempotent producer did so under a
    new epoch and left duplicate tuples (1,340 after one 20 s pause). Written in transactions, the
    committed input holds each tuple the generator counted exactly once."""
    cfg = gen_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=50",
        "generator.max_tuples=null",
        "generator.rate={kind: constant, rate: 3000}",
    )
    result: dict[str, Any] = {}
    # Requests time out after 5 s (not 60): the client gives up on a request the broker may yet write.
    quick = {"socket.timeout.ms": 5000}

    def write() -> None:
        result.update(run_generator(cfg, own_broker.bootstrap, producer_overrides=quick))

    writer = threading.Thread(target=write)
    writer.start()
    for _ in range(3):
        time.sleep(3)
        own_broker.container.pause()
        try:
            time.sleep(12)
        finally:
            own_broker.container.unpause()
    writer.join(timeout=300)
    assert not writer.is_alive(), "the generator did not finish after the pauses"
    for stream in cfg.streams:
        ids = tuple_ids(read_all(own_broker.bootstrap, cfg.input_topic(stream), PARTITIONS))
        assert len(ids) == result["per_stream"][stream], stream
        assert len(np.unique(ids)) == len(ids), (
            f"stream {stream}: {len(ids) - len(np.unique(ids))} repeated ids"
        )


def test_topics_are_created_once_with_the_right_shape(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(topic_prefix)
    errors: list[BaseException] = []

    def create() -> None:
        try:
            ensure_topics(cfg, kafka_bootstrap)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(3)]  # racing creators
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ensure_topics(cfg, kafka_bootstrap)  # and again, idempotently
    admin = admin_client(kafka_bootstrap)
    md = admin.list_topics(timeout=10)
    expected = {
        **{t: PARTITIONS for t in cfg.input_topics},
        cfg.results_topic: PARTITIONS,
        cfg.dead_letter_topic: 1,
        cfg.sink_commits_topic: 1,
        cfg.metrics_topic: 1,
        cfg.control_topic: 1,
    }
    assert {name: len(md.topics[name].partitions) for name in expected} == expected
    resource = ConfigResource(ConfigResource.Type.TOPIC, cfg.sink_commits_topic)
    configs = admin.describe_configs([resource])[resource].result()
    assert configs["cleanup.policy"].value == "compact"
    assert configs["segment.ms"].value == str(COMMITS_SEGMENT_MS)


def test_the_topics_named_after_a_prefix_are_deleted(kafka_bootstrap: str, topic_prefix: str) -> None:
    """How a benchmark run drops its pipelines' topics, and only theirs."""
    runs = [gen_config(f"{topic_prefix}-run-{i}") for i in range(2)]
    other = gen_config(f"{topic_prefix}-other")
    for cfg in [*runs, other]:
        ensure_topics(cfg, kafka_bootstrap)
    expected = sorted(s.name for cfg in runs for s in topic_specs(cfg))
    assert topics_named_after(kafka_bootstrap, f"{topic_prefix}-run-") == expected
    delete_topics(kafka_bootstrap, expected)
    deadline = time.monotonic() + 60
    while topics_named_after(kafka_bootstrap, f"{topic_prefix}-run-"):
        assert time.monotonic() < deadline, "deleted topics still listed after 60 s"
        time.sleep(0.5)
    assert topics_named_after(kafka_bootstrap, f"{topic_prefix}-other") == sorted(
        s.name for s in topic_specs(other)
    )
    delete_topics(kafka_bootstrap, expected)  # already gone: fine


def test_wrong_partition_count_is_refused(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(topic_prefix)
    wrong = NewTopic(cfg.input_topic("B"), PARTITIONS + 1, -1)
    admin = admin_client(kafka_bootstrap)  # kept referenced until the future resolves
    admin.create_topics([wrong])[cfg.input_topic("B")].result()
    with pytest.raises(TopicError, match=rf"{cfg.input_topic('B')} exists with {PARTITIONS + 1} partitions"):
        ensure_topics(cfg, kafka_bootstrap)
    with pytest.raises(TopicError):
        run_generator(cfg, kafka_bootstrap)


def test_unreachable_broker_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port now.
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable, match=rf"cannot reach Kafka at 127.0.0.1:{port} within 2 s"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    assert time.monotonic() - started < 5
    with pytest.raises(BrokerUnreachable):
        run_generator(gen_config("unreachable"), f"127.0.0.1:{port}")
