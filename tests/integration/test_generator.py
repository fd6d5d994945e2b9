"""The generator against a real broker: what lands in the input topics, and topic checks."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import ConfigResource, NewTopic

from generator.producer import run_generator
from pipeline.codec import decode_tuples
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
    topic_specs,
    topics_named_after,
)

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


def read_all(bootstrap: str, topic: str, partitions: int) -> list[Message]:
    """Every message of `topic`: read up to the high watermarks, then again while they still move.

    A fresh look at the watermarks after reaching them makes the read complete even if the first
    look raced the broker's last acknowledged append.
    """
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "unused", "enable.auto.commit": False})

    def high_watermarks() -> dict[int, int]:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }

    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out: list[Message] = []
        positions = dict.fromkeys(range(partitions), 0)
        deadline = time.monotonic() + 60
        ends = high_watermarks()
        while True:
            while any(positions[p] < ends[p] for p in ends):
                assert time.monotonic() < deadline, f"timed out reading {topic}"
                for msg in consumer.consume(1000, timeout=1.0):
                    assert msg.error() is None, msg.error()
                    partition, offset, value = msg.partition(), msg.offset(), msg.value()
                    assert partition is not None and offset is not None
                    assert value is not None
                    positions[partition] = offset + 1
                    out.append(Message(partition, msg.key(), msg.timestamp()[1], value))
            latest = high_watermarks()
            if latest == ends:
                return out
            ends = latest
    finally:
        consumer.close()


def test_generated_tuples_land_in_their_pid_partitions(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = gen_config(topic_prefix)
    stats = run_generator(cfg, kafka_bootstrap)
    assert stats["tuples"] == 20_000
    assert sum(stats["per_stream"].values()) == 20_000
    assert set(stats["per_stream"]) == {"A", "B", "C"}
    messages = 0
    for stream in cfg.streams:
        ids, event_times = [], []
        for msg in read_all(kafka_bootstrap, cfg.input_topic(stream), PARTITIONS):
            messages += 1
            assert msg.key == str(msg.partition).encode()
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
            b = decode_tuples(msg.value)
            rows.append(np.column_stack([b.ids, b.keys, b.event_times - start_ms, b.payload]))
        table = np.concatenate(rows)
        assert len(table) == produced_b, f"{cfg.pipeline}: read {len(table)} of {produced_b} tuples"
        return table[np.argsort(table[:, 0])]

    np.testing.assert_array_equal(tuples(rt, rt_stats["start_ms"]), tuples(mr, mr_stats["start_ms"]))


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
