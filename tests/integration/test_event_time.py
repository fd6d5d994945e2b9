"""Lateness depends on the input alone (decision 0047): streams read out of step, a stream pre-loaded far
ahead of another, and a stream silent for some pids, each on real instances, judged by the oracle's
input-only rule."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from confluent_kafka import Producer

from generator.producer import run_generator
from local.processes import LocalPipeline, wait_drained
from pipeline.codec import encode_tuples
from pipeline.config import Config
from pipeline.partitioning import pids_of
from pipeline.topics import ensure_topics, read_topic
from tests.integration.test_pipeline import drain_with_one_instance, small_config


def _verify(cfg: Config, bootstrap: str) -> None:
    from pipeline.oracle import verify_pipeline

    report = verify_pipeline(cfg, bootstrap)
    assert report.expected > 1_000, report.describe()
    assert (report.late_expected, report.late_reported) == (0, 0), report.describe()
    assert report.exact, report.describe()


def test_streams_produced_out_of_step_onto_instances_started_late_lose_nothing(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """B's producer runs 5 s behind A's (each in order), and two instances start 8 s into a 40 s run,
    onto the backlog that piled up meanwhile, then follow the live input. A pid-wide watermark
    dead-lettered B's on-time tuples here."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=40",
        "generator.rate={kind: constant, rate: 1000}",
        "generator.keys={kind: uniform, count: 1500}",
        "generator.stream_lag_ms={B: 5000}",
    )
    produced: dict[str, object] = {}
    generator = threading.Thread(target=lambda: produced.update(run_generator(cfg, kafka_bootstrap)))
    generator.start()
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        time.sleep(8)
        pipeline.start_instance("instance-0", range(0, 4))
        pipeline.start_instance("instance-1", range(4, 8))
        generator.join(timeout=120)
        assert produced, "the generator did not finish"
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    _verify(pipeline.cfg, kafka_bootstrap)


def _produce_span(cfg: Config, bootstrap: str, stream: str, start_ms: int, from_s: int, to_s: int) -> None:
    """Tuples of `stream` at 200 per second of event time over [from_s, to_s), keys 0..399, ids from
    the event time's offset (unique per stream), in event-time order per pid, 64 per message."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    offsets = np.arange(from_s * 200, to_s * 200, dtype=np.int64)  # one tuple every 5 ms
    keys = offsets % 400
    ts = start_ms + offsets * 5
    pids = pids_of(keys, cfg.partitions)
    for pid in range(cfg.partitions):
        mine = np.flatnonzero(pids == pid)
        for a in range(0, len(mine), 64):
            rows = mine[a : a + 64]
            value = encode_tuples(offsets[rows], keys[rows], ts[rows], np.zeros((len(rows), 0), np.uint8))
            producer.produce(cfg.input_topic(stream), value=value, partition=pid, timestamp=int(ts[rows][0]))
    assert producer.flush(60) == 0


def test_a_stream_preloaded_30_s_ahead_of_the_other_loses_nothing(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A's first 60 s are in Kafka before B has 30 s, and the instances read both; B's next 30 s come
    after A has been read to its end. Judged by the pid's newest event time over every stream, all of
    them were late."""
    cfg = small_config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    start_ms = int(time.time() * 1000) - 120_000
    _produce_span(cfg, kafka_bootstrap, "A", start_ms, 0, 60)
    _produce_span(cfg, kafka_bootstrap, "B", start_ms, 0, 30)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        pipeline.start_instance("instance-0", range(0, 4))
        pipeline.start_instance("instance-1", range(4, 8))
        wait_drained(pipeline, timeout_s=300)
        _produce_span(cfg, kafka_bootstrap, "B", start_ms, 30, 60)
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    _verify(pipeline.cfg, kafka_bootstrap)


def test_a_stream_silent_on_some_pids_for_three_windows_keeps_state_bounded_and_results_exact(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """B writes no tuple to pids 0 and 1 for 3 x W while A flows on every pid, and the generator's
    progress records tell how far B has come. Without them, A's window of those pids would grow over
    the silence (B's next tuple could be as old as its last); with them it stays within what the
    other pids hold, and once B is back its tuples join as before."""
    window_ms = 2000
    cfg = small_config(
        topic_prefix,
        f"window_ms={window_ms}",
        "generator.mode=real_time",
        "generator.duration_s=16",
        "generator.rate={kind: constant, rate: 2000}",
        "generator.keys={kind: uniform, count: 2000}",
        f"generator.silences=[{{stream: B, pids: [0, 1], from_s: 4, to_s: {4 + 3 * window_ms / 1000}}}]",
    )
    ensure_topics(cfg, kafka_bootstrap)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        pipeline.start_instance("instance-0", range(0, 8))
        pipeline.wait_running(["instance-0"])  # so that its batches end inside the silence
        run_generator(cfg, kafka_bootstrap)
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    batches = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.metrics_topic)]
    held: dict[int, int] = {}
    for b in batches:
        if b.get("kind") == "batch":
            for pid, s in b["pids"].items():
                held[int(pid)] = max(held.get(int(pid), 0), int(s["window_tuples"]))
    others = statistics.median(held[p] for p in range(2, 8))
    assert max(held[0], held[1]) <= 1.2 * others, f"silent pids held {held[0]}, {held[1]}; others {others}"
    _verify(pipeline.cfg, kafka_bootstrap)


def test_tuples_written_late_on_purpose_are_dead_lettered_and_nothing_else(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    from pipeline.oracle import verify_pipeline

    cfg = small_config(
        topic_prefix, "generator.max_tuples=30000", "generator.duration_s=null", "generator.late_tuples=30"
    )
    assert run_generator(cfg, kafka_bootstrap)["late_injected"] == 30
    pipeline = drain_with_one_instance(cfg, kafka_bootstrap, tmp_path)
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert (report.late_expected, report.late_reported, report.wrongly_late) == (30, 30, 0), report.describe()
    assert report.exact, report.describe()
