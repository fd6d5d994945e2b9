"""`fluxjoin verify` on a real broker, as a user runs it: a skewed input whose expected join is larger
than memory could hold, input late on purpose, a wrong partition count, repeated input ids."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Producer

from generator.producer import run_generator
from pipeline.codec import encode_tuples
from pipeline.partitioning import pids_of
from pipeline.topics import ensure_topics
from tests.integration.test_pipeline import small_config

FLUXJOIN = str(Path(sys.executable).with_name("fluxjoin"))


def _verify(bootstrap: str, *sets: str) -> tuple[int, dict[str, Any], str]:
    """Run `fluxjoin verify --json`: exit code, report, stderr."""
    args = [FLUXJOIN, "verify", "--json", "--bootstrap", bootstrap]
    for s in sets:
        args += ["--set", s]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


def _small(prefix: str) -> list[str]:
    """`small_config`'s join settings, as `--set`s for the verify command."""
    return [
        f"pipeline={prefix}",
        "streams=[A, B]",
        "partitions=8",
        "window_ms=2000",
        "allowed_lateness_ms=1000",
    ]


def test_verify_counts_a_join_of_more_than_ten_billion_results_within_two_gigabytes(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """One key carries every tuple: 300,000 per stream at 1,000 per second, W = 20 s, so each tuple has
    about 40,000 partners and the expected join about 1.2 x 10^10 results (hundreds of GB as id rows).
    Nothing ran the join, so every result is missing; the point is that verify counts it, and in how
    much memory (the child's peak resident set, read back from the kernel)."""
    sets = [
        f"pipeline={topic_prefix}",
        "streams=[A, B]",
        "partitions=8",
        "window_ms=20000",
        "allowed_lateness_ms=1000",
    ]
    cfg = small_config(
        topic_prefix,
        "window_ms=20000",
        "generator.rate={kind: constant, rate: 1000}",
        "generator.keys={kind: uniform, count: 1}",
        "generator.max_tuples=600000",
        "generator.duration_s=null",
        "generator.tuples_per_message=4096",
    )
    run_generator(cfg, kafka_bootstrap)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    code, report, err = _verify(kafka_bootstrap, *sets)
    took_s = time.monotonic() - started
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert report, err
    assert report["input_tuples"] == 600_000
    assert report["expected"] > 10**10, report
    assert report["missing"] == report["expected"] and code == 1
    assert max(peak_kb, before) < 2 * 1024 * 1024, f"verify peaked at {peak_kb / 1024:.0f} MB"
    print(f"expected {report['expected']:,}: verify took {took_s:.1f} s, peaked at {peak_kb / 1024:.0f} MB")


def test_verify_finds_exactly_the_late_tuples_injected(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = small_config(topic_prefix, "generator.max_tuples=20000", "generator.duration_s=null")
    late = cfg.with_overrides(**{"generator.late_tuples": 25})
    written = run_generator(late, kafka_bootstrap)
    assert written["late_injected"] == 25
    code, report, err = _verify(kafka_bootstrap, *_small(topic_prefix))
    assert report, err
    assert (report["late_expected"], report["late_reported"], report["late_unreported"]) == (25, 0, 25)
    assert not report["exact"] and code == 1, "late tuples nobody dead-lettered are not exact"


def test_verify_refuses_topics_with_another_partition_count(kafka_bootstrap: str, topic_prefix: str) -> None:
    cfg = small_config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    code, report, err = _verify(kafka_bootstrap, f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=9")
    assert code == 2 and not report
    assert len(err.strip().splitlines()) == 1 and "9" in err and "8" in err, err


def test_verify_reports_repeated_input_ids_and_never_calls_them_exact(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    cfg = small_config(topic_prefix)
    ensure_topics(cfg, kafka_bootstrap)
    keys = np.array([5, 5], dtype=np.int64)
    pid = int(pids_of(keys, cfg.partitions)[0])
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for stream in ("A", "B"):
        ids = np.array([1, 1], dtype=np.int64)  # the same id twice in each stream
        value = encode_tuples(ids, keys, np.array([1000, 1001]), np.zeros((2, 0), np.uint8))
        producer.produce(cfg.input_topic(stream), value=value, partition=pid, timestamp=1000)
    assert producer.flush(30) == 0
    code, report, err = _verify(kafka_bootstrap, f"pipeline={topic_prefix}", "streams=[A, B]", "partitions=8")
    assert report, err
    assert report["duplicate_input_ids"] > 0 and not report["exact"] and code == 1
