"""A hot key under a results bound (decision 0055): a backlog in which one key carries a quarter of each
stream, joined by an instance with a small JVM heap and a small `instance.max_results_per_batch`.

Injected: the skew (a hot set of one key, 25% of the tuples) over a backlog whose whole join is about
twenty times the bound, read by an instance allowed 200,000 tuples a batch and a 768 MB heap.
Asserted: no batch makes more than about the bound (1.5 times), the instance never restarts its
query, its log names the hot key and its pid, and the output is exactly the oracle's. Before batches
were planned per pid from the first one on, the first batch took the whole backlog and the JVM died
(`OutOfDirectMemoryError`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from generator.producer import run_generator
from pipeline.codec import decode_tuple_columns, progress_of
from pipeline.oracle import verify_pipeline
from pipeline.partitioning import pid_of
from pipeline.topics import read_topic
from tests.integration.test_pipeline import drain_with_one_instance, small_config

BOUND = 500_000


def test_a_hot_key_backlog_is_joined_in_batches_within_the_results_bound(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    cfg = small_config(
        topic_prefix,
        "window_ms=1000",
        "generator.max_tuples=80000",
        "generator.duration_s=null",
        "generator.rate={kind: constant, rate: 4000}",
        "generator.keys={kind: hot_set, count: 4000, hot_fraction: 0.00025, hot_share: 0.25, "
        "move_every_s: 1000000}",
        "instance.max_rows_per_batch=200000",
        f"instance.max_results_per_batch={BOUND}",
        "instance.driver_memory=768m",
    )
    run_generator(cfg, kafka_bootstrap)
    keys: Counter[int] = Counter()
    for stream in cfg.streams:
        for _, _, value in read_topic(kafka_bootstrap, cfg.input_topic(stream)):
            if progress_of(value) is None:
                keys.update(decode_tuple_columns(value)[1].tolist())
    hot, hot_tuples = keys.most_common(1)[0]
    assert hot_tuples > 0.2 * sum(keys.values()), "the input has its hot key"

    pipeline = drain_with_one_instance(cfg, kafka_bootstrap, tmp_path)

    records = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.metrics_topic)]
    fed = [b for b in records if b.get("kind") == "batch" and b["tuples_in"]]
    made = [(b["tuples_in"], b["results"]) for b in fed]
    assert max(r for _, r in made) <= 1.5 * BOUND, made
    log = (tmp_path / "instance-0.log").read_text()
    assert "starting the query again" not in log
    assert f"pid {pid_of(hot, cfg.partitions)} made" in log and f"on key {hot}." in log, log[-3000:]
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 10 * BOUND, "the bound had to bind"
    assert report.exact, report.describe()
