"""`fluxjoin bench throughput`: one instance against Spark's built-in stream-stream join, and latency.

Two measurements in one run, on a real broker (the embedded one unless `--bootstrap`):

(a) Catch-up rate. The input topics are pre-loaded (2-way join, W = 10 s, P = 64, uniform keys sized for
    about one result per input tuple); then one fluxjoin instance process reads them from the start with
    nothing else running but the broker, and afterwards Spark's built-in Kafka source and stream-stream
    join (the `spark-sql-kafka-0-10` connector from Maven Central) read the same topics in this process.
    Both decode the same wire format and run in `local[2]` with the same batch cap; both are timed from
    the start of their first micro-batch to the end of the last one, so Spark's start-up is excluded
    from both. The built-in join writes to a counting sink, fluxjoin to Kafka in transactions, so the
    comparison favours the built-in join. fluxjoin's output is also verified against the oracle.
(b) Result latency. The generator in real-time mode at a fixed rate (default 20K tuples/s in total), one
    instance; latency of a result = commit time - max event time of its parts, percentiles over all
    results after a warm-up, weighted by each batch's result count.

Each repeat runs both on fresh topics (only (b) with no tuples to pre-load); the summary holds the
medians and the ratio of medians. The Maven pom of
the built-in baseline's connector, `spark_kafka_pom.xml`, lies beside this module, its only user.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.run import bench_run, drain, follow_input, save_report
from local.processes import LocalPipeline, MetricsFollower, end_offsets, wait_drained, weighted_percentiles
from pipeline.config import Config

SPARK_KAFKA_POM = Path(__file__).with_name("spark_kafka_pom.xml")
# The connector and what it needs beyond the jars PySpark ships.
CONNECTOR_JARS = ("spark-sql-kafka-0-10", "spark-token-provider-kafka-0-10", "kafka-clients", "commons-pool2")


def connector_jars() -> list[Path]:
    """Spark's Kafka connector jars, fetched with Maven into the cache on first use."""
    import hashlib

    from local.kafka_dist import cache_dir, ensure_maven_jars

    key = hashlib.sha256(SPARK_KAFKA_POM.read_bytes()).hexdigest()[:12]
    libs = ensure_maven_jars(
        SPARK_KAFKA_POM, cache_dir() / "spark-kafka" / key, "Spark's Kafka connector", "spark-sql-kafka"
    )
    return sorted(j for j in libs.glob("*.jar") if j.name.startswith(CONNECTOR_JARS))


def catchup_config(base: Config, pipeline: str, tuples: int) -> Config:
    """2-way, W = 10 s, P = 64; 50K tuples/s of event time per stream over 500K uniform keys gives
    rate x W / keys = 1 result per input tuple."""
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=10_000,
        partitions=64,
        instances=1,
        **{
            "generator.mode": "max_rate",
            "generator.duration_s": None,
            "generator.max_tuples": tuples,
            "generator.rate": {"kind": "constant", "rate": 50_000},
            "generator.keys": {"kind": "uniform", "count": 500_000},
            "instance.trigger_ms": 0,
        },
    )


def latency_config(base: Config, pipeline: str, rate: float, seconds: float) -> Config:
    """Real time at `rate` tuples/s in total, keys sized for one result per input tuple."""
    per_stream = rate / 2
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=10_000,
        partitions=64,
        instances=1,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": per_stream},
            "generator.keys": {"kind": "uniform", "count": max(1, int(per_stream * 10))},
            "instance.batch_timings": True,
        },
    )


def _batch_span_s(records: list[dict[str, Any]]) -> float:
    """Seconds from the start of the first batch that read input to the end of the last one."""
    busy = [r for r in records if r["tuples_in"] > 0]
    first_start = min(r["time_ms"] - 1000 * r["duration_s"] for r in busy)
    return (max(r["time_ms"] for r in busy) - first_start) / 1000


def measure_fluxjoin(cfg: Config, bootstrap: str, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """`cfg.instances` instances, each on a contiguous range of the pids, read the pre-loaded topics
    from the start; metrics give the span (the first batch's start to the last one's end, over all
    instances) and the peak of the window state (each instance's largest, summed)."""
    from pipeline.oracle import verify_pipeline
    from pipeline.partitioning import contiguous_ranges

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    try:
        for i, pids in enumerate(contiguous_ranges(cfg.partitions, cfg.instances)):
            pipeline.start_instance(f"instance-{i}", pids)
        wait_drained(pipeline, timeout_s=1800)
        time.sleep(1.0)
        records = [r for r in drain(follower) if r.get("kind") == "batch"]
    finally:
        follower.close()
        pipeline.stop()
    tuples = sum(r["tuples_in"] for r in records)
    span = _batch_span_s(records)
    say(f"fluxjoin: {tuples:,} tuples in {span:.1f} s -> {tuples / span:,.0f} tuples/s; verifying")
    report = verify_pipeline(pipeline.cfg, bootstrap)
    peaks: dict[str, int] = {}
    for r in records:
        peaks[r["instance"]] = max(peaks.get(r["instance"], 0), r["state_bytes"])
    return {
        "tuples": tuples,
        "seconds": round(span, 2),
        "tuples_per_s": round(tuples / span, 1),
        "batches": len(records),
        "results": report.produced,
        "peak_state_bytes": sum(peaks.values()),
        "exact": report.exact,
    }


def decode_messages(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`mapInArrow` body for the built-in baseline: Kafka values (tuple batches) -> (key, ts) rows."""
    from pipeline.codec import decode_tuple_columns, progress_of

    for batch in batches:
        keys, ts = [], []
        for value in batch.column("value").to_pylist():
            if progress_of(value) is not None:
                continue  # a progress record: no tuples
            _, k, t = decode_tuple_columns(value)
            keys.append(k)
            ts.append(t)
        if keys:
            yield pa.RecordBatch.from_arrays(
                [pa.array(np.concatenate(keys)), pa.array(np.concatenate(ts))], names=["key", "ts"]
            )


def measure_builtin(cfg: Config, bootstrap: str, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Spark's Kafka source + stream-stream interval join on the same topics, counting results.

    On a cluster that asks for TLS or SASL it refuses to run: Spark's own Kafka client is configured
    through its options, not `pipeline.kafka_client`, and this baseline does not pass them."""
    from pyspark.sql import functions as F

    from pipeline.kafka_client import KafkaSecurity

    if KafkaSecurity.from_env().protocol != "PLAINTEXT":
        raise ValueError("the built-in baseline needs a PLAINTEXT Kafka (FLUXJOIN_KAFKA_* is set)")

    from pipeline.instance import spark_session

    jars = connector_jars()
    say(f"built-in: Spark's Kafka source with {', '.join(j.name for j in jars)}")
    spark = spark_session(cfg, "fluxjoin-bench-builtin", {"spark.jars": ",".join(str(j) for j in jars)})
    max_messages = max(1, cfg.instance.max_rows_per_batch // cfg.generator.tuples_per_message)
    lateness = f"{cfg.allowed_lateness_ms} milliseconds"

    def side(stream: str) -> Any:
        raw = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", cfg.input_topic(stream))
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", str(max_messages // len(cfg.streams)))
            .load()
        )
        rows = raw.select("value").mapInArrow(decode_messages, "key long, ts long")
        rows = rows.withColumn("et", F.timestamp_millis("ts")).withWatermark("et", lateness)
        return rows.select(F.col("key").alias(f"k_{stream}"), F.col("et").alias(f"t_{stream}"))

    a, b = side(cfg.streams[0]), side(cfg.streams[1])
    ta, tb = f"t_{cfg.streams[0]}", f"t_{cfg.streams[1]}"
    w = f"interval {cfg.window_ms} milliseconds"
    joined = a.join(
        b,
        F.expr(f"k_{cfg.streams[0]} = k_{cfg.streams[1]} AND {tb} BETWEEN {ta} - {w} AND {ta} + {w}"),
    )
    results = [0]

    def count(df: Any, _batch_id: int) -> None:
        results[0] += df.count()

    total_messages = sum(end_offsets(cfg, bootstrap).values())
    query = (
        joined.writeStream.foreachBatch(count)
        .option("checkpointLocation", str(work / "builtin-checkpoint"))
        .trigger(processingTime="0 seconds")
        .start()
    )
    deadline = time.monotonic() + 1800
    try:
        while _consumed(query.recentProgress) < total_messages:
            if query.exception() is not None:
                raise RuntimeError(f"the built-in join failed: {query.exception()}")
            if time.monotonic() > deadline:
                raise TimeoutError("the built-in join did not catch up within 30 minutes")
            time.sleep(0.5)
        progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    finally:
        query.stop()
        spark.stop()
    first_start = min(_ms(p["timestamp"]) for p in progress)
    last_end = max(_ms(p["timestamp"]) + p["durationMs"]["triggerExecution"] for p in progress)
    span = (last_end - first_start) / 1000
    tuples = cfg.generator.max_tuples or 0
    say(f"built-in: {tuples:,} tuples in {span:.1f} s -> {tuples / span:,.0f} tuples/s")
    return {
        "tuples": tuples,
        "seconds": round(span, 2),
        "tuples_per_s": round(tuples / span, 1),
        "batches": len(progress),
        "results": results[0],
    }


def _median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are known; None when none is."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ms(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1000


def _consumed(progress: list[dict[str, Any]]) -> int:
    """Kafka messages the query has read, from the end offsets of its newest progress report."""
    if not progress:
        return 0
    total = 0
    for source in progress[-1]["sources"]:
        end = source["endOffset"]
        end = json.loads(end) if isinstance(end, str) else end
        total += sum(int(o) for parts in end.values() for o in parts.values())
    return total


def measure_latency(cfg: Config, bootstrap: str, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """One instance, the generator in real time; percentiles over results after the first 15 s, and
    where the time of the batches after the first 15 s went (`pipeline.batch_timings`): the slowest 1%
    and the median batch, per phase."""
    from pipeline.batch_timings import breakdown, read_batch_timings, slowest_breakdown
    from pipeline.instance import instance_dir

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    try:
        pipeline.start_instance("instance-0", range(cfg.partitions))
        pipeline.wait_running(["instance-0"])
        pipeline.start_generator()
        started_ms = time.time() * 1000
        say(f"latency: {cfg.generator.duration_s:.0f} s of real-time input")
        follow_input(pipeline, follower, records)
        wait_drained(pipeline, timeout_s=300)
        time.sleep(1.0)
        records.extend(drain(follower))
        generated = pipeline.generator_summary() or {}
    finally:
        follower.close()
        pipeline.stop()
    steady = [
        r
        for r in records
        if r.get("kind") == "batch" and r["time_ms"] >= started_ms + 15_000 and r["results"]
    ]
    p50, p99 = weighted_percentiles(steady, (50, 99))
    tuples = sum(r["tuples_in"] for r in records if r.get("kind") == "batch")
    say(f"latency: p50 {p50} s, p99 {p99} s over {len(steady)} batches")
    timings = [
        t
        for t in read_batch_timings(instance_dir(pipeline.cfg, "instance-0") / "batch_timings.jsonl")
        if _ms(t["timestamp"]) >= started_ms + 15_000 and t["input_rows"]
    ]
    slowest = slowest_breakdown(timings)
    median = {}
    if timings:
        ranked = sorted(timings, key=lambda t: t["spark_ms"]["triggerExecution"])
        median = {k: round(v, 3) for k, v in breakdown(ranked[len(ranked) // 2]).items()}
        say("latency: slowest 1% of batches, s: " + ", ".join(f"{k} {v}" for k, v in slowest.items()))
    delay = generated.get("commit_delay_s")
    if delay:
        say(f"latency: input readable after its tick: p50 {delay['p50']} s, p99 {delay['p99']} s")
    return {
        "tuples": tuples,
        "batches": len(steady),
        "latency_p50_s": p50,
        "latency_p99_s": p99,
        "slowest_batches": slowest,
        "median_batch": median,
        "input_commit_delay_s": delay,
        # Per batch: seconds since the input began, tuples read, input messages left beyond it at its
        # commit, and its p50 latency: a stretch of high latency with nothing left to read is input
        # that became readable late; with a backlog left, the instance fell behind.
        "batches_series": [
            [
                round((r["time_ms"] - started_ms) / 1000, 2),
                r["tuples_in"],
                sum(r["lag"].values()),
                r["latency_p50_s"],
            ]
            for r in records
            if r.get("kind") == "batch"
        ],
    }


def run_throughput_bench(
    cfg: Config,
    tuples: int = 2_000_000,
    repeats: int = 1,
    latency_rate: float = 20_000,
    latency_s: float = 60,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run (a) and (b) `repeats` times each ((a) not at all with no `tuples`); return the summary of
    medians (also written under reports/bench/)."""
    from generator.producer import run_generator

    ours, builtin, latency = [], [], []
    with bench_run(cfg, "throughput", say) as run:
        for i in range(repeats):
            if tuples:
                c = catchup_config(cfg, f"{run.run_id}-catchup-{i}", tuples)
                say(f"[{i + 1}/{repeats}] pre-loading {tuples:,} tuples into {', '.join(c.input_topics)}")
                run_generator(c, run.bootstrap)
                ours.append(measure_fluxjoin(c, run.bootstrap, run.work / f"catchup-{i}", say))
                builtin.append(measure_builtin(c, run.bootstrap, run.work / f"catchup-{i}", say))
            lat_cfg = latency_config(cfg, f"{run.run_id}-latency-{i}", latency_rate, latency_s)
            latency.append(measure_latency(lat_cfg, run.bootstrap, run.work / f"latency-{i}", say))
    ours_rate = _median(r["tuples_per_s"] for r in ours)
    builtin_rate = _median(r["tuples_per_s"] for r in builtin)
    summary = {
        "tuples_per_s": ours_rate,
        "builtin_tuples_per_s": builtin_rate,
        "ratio": round(ours_rate / builtin_rate, 2) if ours_rate and builtin_rate else None,
        "latency_p50_s": _median(r["latency_p50_s"] for r in latency),
        "latency_p99_s": _median(r["latency_p99_s"] for r in latency),
        "exact": all(r["exact"] for r in ours),
        "tuples": tuples,
        "repeats": repeats,
        "latency_rate": latency_rate,
        "runs": {"fluxjoin": ours, "builtin": builtin, "latency": latency},
    }
    save_report(run.run_id, "throughput", summary, say)
    return summary
