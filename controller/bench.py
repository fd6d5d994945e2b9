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

Each repeat uses fresh topics; the summary holds the medians and the ratio of medians.
"""

from __future__ import annotations

import json
import math
import re
import signal
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from controller.local import (
    LocalPipeline,
    MetricsFollower,
    ProcessFailed,
    end_offsets,
    wait_drained,
    weighted_percentiles,
)
from pipeline.config import Config, HotPidsKeys

SPARK_KAFKA_POM = Path(__file__).with_name("spark_kafka_pom.xml")
# The connector and what it needs beyond the jars PySpark ships.
CONNECTOR_JARS = ("spark-sql-kafka-0-10", "spark-token-provider-kafka-0-10", "kafka-clients", "commons-pool2")


def connector_jars() -> list[Path]:
    """Spark's Kafka connector jars, fetched with Maven into the cache on first use."""
    import hashlib

    from controller.kafka_runtime import cache_dir, ensure_maven_jars

    key = hashlib.sha256(SPARK_KAFKA_POM.read_bytes()).hexdigest()[:12]
    libs = ensure_maven_jars(
        SPARK_KAFKA_POM, cache_dir() / "spark-kafka" / key, "Spark's Kafka connector", "spark-sql-kafka"
    )
    return sorted(j for j in libs.glob("*.jar") if j.name.startswith(CONNECTOR_JARS))


def new_run(cfg: Config, kind: str) -> tuple[str, Path]:
    """A fresh run id (also the prefix of the run's pipeline names) and its work directory."""
    run_id = f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    return run_id, Path(cfg.instance.work_dir).resolve() / run_id


def drop_run_topics(bootstrap: str, run_id: str, say: Callable[[str], None]) -> None:
    """Delete the topics of a finished run (its pipelines are named after it), so repeated runs do not
    pile up data on the broker: a broker restarted over gigabytes of old runs takes minutes to load."""
    from pipeline.topics import delete_topics, topics_named_after

    names = topics_named_after(bootstrap, f"{run_id}-")
    delete_topics(bootstrap, names)
    say(f"deleted the run's {len(names)} topics")


def save_report(run_id: str, name: str, summary: dict[str, Any], say: Callable[[str], None]) -> None:
    """Write the summary to reports/bench/<run id>/<name>.json and say where."""
    out = Path("reports") / "bench" / run_id
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    say(f"report: {out / f'{name}.json'}")


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
        },
    )


def _batch_span_s(records: list[dict[str, Any]]) -> float:
    """Seconds from the start of the first batch that read input to the end of the last one."""
    busy = [r for r in records if r["tuples_in"] > 0]
    first_start = min(r["time_ms"] - 1000 * r["duration_s"] for r in busy)
    return (max(r["time_ms"] for r in busy) - first_start) / 1000


def measure_fluxjoin(cfg: Config, bootstrap: str, work: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """One instance owning every pid reads the pre-loaded topics from the start; metrics give the span."""
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    try:
        pipeline.start_instance("instance-0", range(cfg.partitions))
        wait_drained(pipeline, timeout_s=900)
        time.sleep(1.0)
        records = [r for r in _drain(follower) if r.get("kind") == "batch"]
    finally:
        follower.close()
        pipeline.stop()
    tuples = sum(r["tuples_in"] for r in records)
    span = _batch_span_s(records)
    say(f"fluxjoin: {tuples:,} tuples in {span:.1f} s -> {tuples / span:,.0f} tuples/s; verifying")
    report = verify_pipeline(pipeline.cfg, bootstrap)
    return {
        "tuples": tuples,
        "seconds": round(span, 2),
        "tuples_per_s": round(tuples / span, 1),
        "batches": len(records),
        "results": report.produced,
        "exact": report.exact,
    }


def _drain(follower: MetricsFollower) -> Iterator[dict[str, Any]]:
    """Everything the follower has, until a poll returns nothing."""
    while True:
        got = list(follower.poll())
        if not got:
            return
        yield from got


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
    """One instance, the generator in real time; percentiles over results after the first 15 s."""
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
        records.extend(_drain(follower))
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
    return {"tuples": tuples, "batches": len(steady), "latency_p50_s": p50, "latency_p99_s": p99}


def run_throughput_bench(
    cfg: Config,
    tuples: int = 2_000_000,
    repeats: int = 1,
    latency_rate: float = 20_000,
    latency_s: float = 60,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run (a) `repeats` times and (b) once; return the summary (also written under reports/bench/)."""
    from controller.kafka_runtime import broker_unless
    from generator.producer import run_generator

    run_id, work = new_run(cfg, "throughput")
    ours, builtin = [], []
    with broker_unless(cfg.bootstrap) as bootstrap:
        for i in range(repeats):
            c = catchup_config(cfg, f"{run_id}-catchup-{i}", tuples)
            say(f"[{i + 1}/{repeats}] pre-loading {tuples:,} tuples into {', '.join(c.input_topics)}")
            run_generator(c, bootstrap)
            ours.append(measure_fluxjoin(c, bootstrap, work / f"catchup-{i}", say))
            builtin.append(measure_builtin(c, bootstrap, work / f"catchup-{i}", say))
        lat_cfg = latency_config(cfg, f"{run_id}-latency", latency_rate, latency_s)
        lat = measure_latency(lat_cfg, bootstrap, work / "latency", say)
        drop_run_topics(bootstrap, run_id, say)
    ours_rate = statistics.median(r["tuples_per_s"] for r in ours)
    builtin_rate = statistics.median(r["tuples_per_s"] for r in builtin)
    summary = {
        "tuples_per_s": ours_rate,
        "builtin_tuples_per_s": builtin_rate,
        "ratio": round(ours_rate / builtin_rate, 2),
        "latency_p50_s": lat["latency_p50_s"],
        "latency_p99_s": lat["latency_p99_s"],
        "exact": all(r["exact"] for r in ours),
        "tuples": tuples,
        "repeats": repeats,
        "latency_rate": latency_rate,
        "runs": {"fluxjoin": ours, "builtin": builtin, "latency": lat},
    }
    save_report(run_id, "throughput", summary, say)
    return summary


# --- fluxjoin bench skew: static vs flux under skew that moves, each instance on a fixed CPU budget ---


FLUX_SKEW_MODE = "replay"
"""Flux's moves run as replays (decision 0036). A transfer pauses the moved pid, a hot one carrying
many results, for about three 4 s triggers. A parallel track never pauses it, but its donor goes on
joining the pid's new tuples with the old ones for a window, so the relief comes W after the move.
A replay pauses the pid for about two batch intervals (decisions 0035, 0037) and relieves the donor
at once: side by side at 2,000 tuples/s, flux's p99 was 8.0 s with replays and 10.2 s with parallel
tracks."""
FLUX_SKEW_MOVES_PER_PAIR = 8
"""Flux may move up to this many pids per pair and round (decision 0012): the hot set is 13 pids."""
FLUX_SKEW_MIN_MOVE_SHARE = 0.25
"""A pid that processed less than this share of its donor's largest pid's tuples stays put (decision
0021). A hot pid carries 16 times a cold one's tuples here (80% of them on 20% of the pids); at 750
tuples/s rounds moved up to 16 cold pids at a time, each worth 0.001-0.004 of its donor's time, off
instances that read as loaded by the hot pids on their way to them."""


def skew_trigger_ms(idle_batch_s: float) -> int:
    """The skew benchmark's trigger: twice an idle instance's micro-batch, rounded up to whole seconds,
    so that an idle instance idles about half the time and busy fractions tell it from a loaded one.
    With back-to-back batches every instance reads as fully busy and no policy can see the skew
    (measured at 0.25 cores and a 4 s trigger: every instance read U = 1.0, and flux moved one pid in
    90 s)."""
    return 1000 * math.ceil(2 * idle_batch_s - 1e-9)


CALIBRATION_INPUT_S = 40.0
"""Seconds of input in the trigger's calibration; its batches after the first 10 s give the median."""


def measure_idle_batch_s(
    cfg: Config,
    bootstrap: str,
    run_id: str,
    work: Path,
    rate: float,
    instances: int,
    cpu: float,
    key_seconds: float,
    say: Callable[[str], None],
) -> float:
    """The median micro-batch of an idle instance of the skew shape, on this machine: the benchmark's
    instances on the `cpu` budget, each owning its share of the pids, fed what instances away from the
    hot set get at `rate` (the 20% of tuples outside the hot set, spread evenly, over the benchmark's
    keys), with a 1 s trigger so that batches run back to back.

    Measured rather than assumed (decision 0016): an idle batch's cost assumed from one machine made
    every instance read as busy on a machine twice as slow, and flux saw no skew to act on. Measured on
    the benchmark's own instances (decision 0026): one instance owning all 64 pids took 6.8 s where the
    benchmark's idle instances took 3.3-3.7 s: a 14 s trigger where 8 s would do, and a pipeline that
    keeps up shows its results a trigger later."""
    name = f"{run_id}-calibration"
    cold = 0.2  # the share of the input outside the hot set; key_seconds scaled to the benchmark's keys
    c = skew_config(
        cfg, name, cold * rate, 0.0, instances, cpu, key_seconds / cold, 1000, even_s=CALIBRATION_INPUT_S
    )
    pipeline = LocalPipeline(c, bootstrap, work / name)
    follower = MetricsFollower(c, bootstrap)
    records: list[dict[str, Any]] = []
    try:
        start_warm(pipeline, follower, records, "static")
        started_ms = time.time() * 1000
        follow_input(pipeline, follower, records)
    finally:
        follower.close()
        pipeline.stop()
    durations = [
        r["duration_s"] for r in records if r.get("kind") == "batch" and r["time_ms"] >= started_ms + 10_000
    ]
    if not durations:
        raise RuntimeError(
            f"the trigger's calibration saw no micro-batch in {CALIBRATION_INPUT_S:g} s of input"
        )
    idle_s = round(statistics.median(durations), 2)
    say(f"skew: an idle batch takes {idle_s} s on {cpu:g} cores: trigger {skew_trigger_ms(idle_s)} ms")
    return idle_s


def flux_skew_params(trigger_ms: int) -> dict[str, float]:
    """Flux collects over two triggers at least (a shorter interval holds no batch of some instances),
    may move several pids per pair but none too small to matter (decision 0021) and charges a moved
    pid at the donor's cost (decision 0012): the instances are alike, and a hot pid's tuples join far
    more partners than the receiver's own. The round after a move phase comes delta_min after it
    (decision 0014): a receiver's catch-up with the moved backlog can last longer than what is left of
    the input after the hot set moves."""
    two_triggers = 2 * trigger_ms / 1000
    return {
        "delta_s": two_triggers,
        "delta_min_s": two_triggers,
        "max_moves_per_pair": FLUX_SKEW_MOVES_PER_PAIR,
        "min_move_share": FLUX_SKEW_MIN_MOVE_SHARE,
        "donor_cost": 1.0,
        "phase_interval": 0.0,
    }


def sustained_drain_s(trigger_ms: int) -> float:
    """A rate is sustained when the backlog left at the end of the input drains within 10 s beyond the
    two triggers a keeping-up pipeline may need to show its last input done."""
    return 10 + 2 * trigger_ms / 1000


def skew_config(
    base: Config,
    pipeline: str,
    rate: float,
    seconds: float,
    instances: int,
    cpu: float,
    key_seconds: float,
    trigger_ms: int,
    hot_set_s: float = 60.0,
    even_s: float = 0.0,
) -> Config:
    """2-way, W = 10 s, P = 64; after `even_s` seconds of input spread evenly over the pids (warming
    the join up, decision 0020), `seconds` in which 20% of the pids carry 80% of the tuples and the hot
    pids change every `hot_set_s`; each instance runs on `cpu` cores (a cgroup quota), so skew cannot
    hide in shared cores.
    As many distinct keys as `key_seconds` of one stream's input (at least 8 per pid, so that every
    pid has keys): a tuple has about 2 W / key_seconds partners on average whatever the rate, so a
    smaller value makes a heavier join per tuple, and the work grows with the rate, not its square.

    A loaded instance's micro-batches grow with its backlog (one of 66 s was measured). Capping
    them at one trigger's worth of input was tried: every batch pays the fixed cost, and static's
    drain at 2,000 tuples/s went from 70 s to 102 s (one run each), so only the default bounds apply,
    the one on results among them (decision 0045).

    Each instance's JVM has a 2 GB heap: a loaded instance's batch collects millions of results at once
    (a 1 GB heap ran out on static's hot instance at 3,000 tuples/s once its batches ran as one task,
    decision 0033).

    The hot pids are contiguous, so under the static layout (contiguous pid ranges) they load one or
    two instances: with scattered hot pids each of 4 instances holds about its share of them, and the
    static layout is balanced by construction."""
    per_stream, partitions = rate / 2, 64
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=10_000,
        partitions=partitions,
        instances=instances,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": even_s + seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": per_stream},
            "generator.keys": {
                "kind": "hot_pids",
                "count": max(8 * partitions, int(per_stream * key_seconds)),
                "hot_fraction": 0.2,
                "hot_share": 0.8,
                "move_every_s": hot_set_s,
                "layout": "contiguous",
                "even_s": even_s,
            },
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
            "instance.driver_memory": "2g",
            "instance.trigger_ms": trigger_ms,
            "instance.cpu_limit": cpu,
        },
    )


def follow_input(pipeline: LocalPipeline, follower: MetricsFollower, records: list[dict[str, Any]]) -> None:
    """Keep the metrics records read until the generator exits; raise if a process failed meanwhile."""
    while pipeline.procs["generator"].poll() is None:
        records.extend(follower.poll())
        pipeline.check_alive()


def wait_warm(
    pipeline: LocalPipeline,
    follower: MetricsFollower,
    names: list[str],
    records: list[dict[str, Any]],
    timeout_s: float = 600,
) -> None:
    """Block until every instance has finished a micro-batch, keeping the records read meanwhile.

    The first batch pays for Spark's warm-up (code generation, Python workers, the state store), which
    under a CPU budget of half a core takes half a minute; input sent before that is a backlog that
    says nothing about the policy.
    """
    pending = set(names)
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in follower.poll():
            records.append(r)
            if r.get("kind") == "batch":
                pending.discard(r["instance"])
        pipeline.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(sorted(pending))} finished no micro-batch in {timeout_s:.0f} s")


def start_warm(
    pipeline: LocalPipeline,
    follower: MetricsFollower,
    records: list[dict[str, Any]],
    policy: str,
    policy_params: dict[str, float] | None = None,
    mode: str = "transfer",
) -> None:
    """Start the controller and the instances, wait until all are warm, then start the input."""
    from controller.runner import instance_names

    pipeline.start_controller(policy=policy, mode=mode, policy_params=policy_params)
    names = instance_names(pipeline.cfg.instances)
    for name in names:
        pipeline.start_instance(name)
    pipeline.wait_running(names)
    wait_warm(pipeline, follower, names, records)
    pipeline.start_generator()


def hold_assignment(pipeline: LocalPipeline, mode: str) -> None:
    """Restart the controller under the static policy: it completes the moves in flight and starts
    none. Run when the input ends, so that the drain measures the backlog left then. A move started
    after the end reacts to a load that no longer arrives, and a parallel track started then waits
    for event time that no longer advances: at 2,500 tuples/s flux's backlog cleared 30 s after the
    end, and tracks started 27 s after it held the drain to 54 s (decision 0018)."""
    pipeline.kill("controller", signal.SIGTERM)
    pipeline.start_controller(policy="static", mode=mode)


SKEW_DRAIN_TIMEOUT_S = 900
"""A point whose backlog has not drained this long after the input ended is recorded as unfinished
(not sustained, latency and output unknown) and the run goes on: static at twice its limit (6,000
tuples/s) still had 29,139 messages left after 900 s, and the whole run was lost to the timeout."""


def measure_skew_point(
    cfg: Config, bootstrap: str, work: Path, policy: str, say: Callable[[str], None]
) -> dict[str, Any]:
    """One rate under one policy: sustainable when the backlog left at the end of the input drains
    within `sustained_drain_s`, the assignment held from then on (`hold_assignment`); latency
    percentiles over results from the skew's start (after the even warm-up, at least 20 s in). The
    output is checked against the oracle: a policy's moves, several at a time, must lose and
    duplicate nothing. A point that does not drain within SKEW_DRAIN_TIMEOUT_S, or in which a process
    fails (an instance out of heap), is unfinished, with the reason: its results are incomplete, so
    neither its latency nor its exactness is known (both None)."""
    from pipeline.oracle import verify_pipeline

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    records: list[dict[str, Any]] = []
    trigger_ms = cfg.instance.trigger_ms
    rate = cfg.generator.rate.rate * 2  # type: ignore[union-attr]
    try:
        flux = policy == "flux"
        params, mode = (flux_skew_params(trigger_ms), FLUX_SKEW_MODE) if flux else (None, "transfer")
        start_warm(pipeline, follower, records, policy, params, mode)
        started_ms = time.time() * 1000
        drain_s: float | None
        failure: str | None = None
        try:
            follow_input(pipeline, follower, records)
            input_end = time.monotonic()
            hold_assignment(pipeline, mode)
            wait_drained(pipeline, timeout_s=SKEW_DRAIN_TIMEOUT_S)
        except (TimeoutError, ProcessFailed) as stopped:
            failure = str(stopped).splitlines()[0]
            say(f"skew: {policy} at {rate:,.0f} tuples/s unfinished, not sustained: {stopped}")
            drain_s = None
        else:
            drain_s = time.monotonic() - input_end
            time.sleep(1.0)
            records.extend(_drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    moves = sum(1 for line in (work / "controller.log").read_text().splitlines() if line.endswith("started"))
    if drain_s is None:
        unknown = (
            "latency_p50_s",
            "latency_p99_s",
            "results",
            "missing",
            "duplicate",
            "spurious",
            "late_expected",
            "late_reported",
        )
        unfinished = {
            "drain_s": None,
            "sustained": False,
            "unfinished": failure,
            "moves": moves,
            "exact": None,
        }
        return unfinished | dict.fromkeys(unknown)
    keys = cfg.generator.keys
    skew_ms = started_ms + max(20.0, keys.even_s if isinstance(keys, HotPidsKeys) else 0.0) * 1000
    steady = [r for r in records if r.get("kind") == "batch" and r["time_ms"] >= skew_ms]
    p50, p99 = weighted_percentiles([r for r in steady if r["results"]], (50, 99))
    report = verify_pipeline(pipeline.cfg, bootstrap)
    point = {
        "drain_s": round(drain_s, 1),
        "sustained": drain_s <= sustained_drain_s(trigger_ms),
        "latency_p50_s": p50,
        "latency_p99_s": p99,
        "moves": moves,
        "results": report.produced,
        "missing": report.missing,
        "duplicate": report.duplicate,
        "spurious": report.spurious,
        "late_expected": report.late_expected,
        "late_reported": report.late_reported,
        "exact": report.exact,
    }
    say(f"skew: {policy} at {rate:,.0f} tuples/s: {point}")
    return point


def run_skew_bench(
    cfg: Config,
    rates: list[float],
    seconds: float = 240,
    instances: int = 4,
    cpu: float = 0.25,
    key_seconds: float = 1.0,
    hot_set_s: float = 120.0,
    even_s: float = 60.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both policies at each rate (ascending), side by side; stops a policy at its first failed rate.
    The defaults are the setting in which static saturates before the machine does: a quarter core per
    instance, a heavy join per tuple (1 s of keys), and two hot sets of 120 s each."""
    from controller.kafka_runtime import broker_unless

    run_id, work = new_run(cfg, "skew")
    points: dict[str, dict[float, dict[str, Any]]] = {"static": {}, "flux": {}}
    with broker_unless(cfg.bootstrap) as bootstrap:
        idle_s = measure_idle_batch_s(
            cfg, bootstrap, run_id, work, min(rates), instances, cpu, key_seconds, say
        )
        trigger_ms = skew_trigger_ms(idle_s)
        inexact: list[str] = []  # the config files of the points whose output was not exact
        for rate in sorted(rates):
            for policy in ("static", "flux"):
                earlier = points[policy]
                if earlier and not earlier[max(earlier)]["sustained"]:
                    continue
                name = f"{run_id}-{policy}-{int(rate)}"
                c = skew_config(
                    cfg, name, rate, seconds, instances, cpu, key_seconds, trigger_ms, hot_set_s, even_s
                )
                earlier[rate] = measure_skew_point(c, bootstrap, work / name, policy, say)
                if earlier[rate]["exact"] is False:
                    inexact.append(str(work / name / "config.yaml"))
        if inexact:  # the evidence of a wrong result outweighs the broker's disk
            configs = " ".join(inexact)
            say(f"kept the run's topics, a point was not exact: fluxjoin verify -c CONFIG for {configs}")
        else:
            drop_run_topics(bootstrap, run_id, say)
    setting = {"hot_set_s": hot_set_s, "even_s": even_s, "idle_batch_s": idle_s, "trigger_ms": trigger_ms}
    summary = {policy: skew_summary(by_rate, setting) for policy, by_rate in points.items()}
    summary["flux"]["against_static"] = against_static(summary["static"], summary["flux"])
    say(f"skew: flux against static: {summary['flux']['against_static']}")
    save_report(run_id, "skew", summary, say)
    return summary


def against_static(static: dict[str, Any], flux: dict[str, Any]) -> dict[str, Any]:
    """The issue's two ratios, from the two policies' lines of one run (`skew_summary`).

    Static's saturation rate is the lowest rate it did not sustain. `rate_ratio` is flux's sustainable
    rate over static's (None when static sustained no rate tried); `rate_ratio_at_least` divides by
    the saturation rate instead, a lower bound of the true ratio whatever static's limit below it is.
    The latency ratios are static's over flux's at the saturation rate (None where a point is
    missing or unfinished)."""

    def ratio(num: float | None, den: float | None) -> float | None:
        return round(num / den, 2) if num is not None and den else None

    failed = [rate for rate, p in static["points"].items() if not p["sustained"]]
    saturation = min(failed, key=int) if failed else None
    saturation_rate = float(saturation) if saturation else None
    at_static, at_flux = static["points"].get(saturation, {}), flux["points"].get(saturation, {})
    return {
        "rate_ratio": ratio(flux["sustainable_rate"], static["sustainable_rate"]),
        "rate_ratio_at_least": ratio(flux["sustainable_rate"], saturation_rate),
        "static_saturation_rate": saturation_rate,
        "latency_p50_ratio": ratio(at_static.get("latency_p50_s"), at_flux.get("latency_p50_s")),
        "latency_p99_ratio": ratio(at_static.get("latency_p99_s"), at_flux.get("latency_p99_s")),
    }


def skew_summary(by_rate: dict[float, dict[str, Any]], setting: dict[str, Any]) -> dict[str, Any]:
    """One policy's line of the skew report: its largest sustained rate with the latency there, and
    whether every point it verified was exact (an unfinished point, exact None, was not verified)."""
    ok = [r for r, p in by_rate.items() if p["sustained"]]
    best = max(ok) if ok else 0.0
    at = by_rate.get(best, {})
    return {
        "sustainable_rate": best,
        **setting,
        "latency_p50_s": at.get("latency_p50_s"),
        "latency_p99_s": at.get("latency_p99_s"),
        "exact": all(p["exact"] for p in by_rate.values() if p["exact"] is not None),
        "points": {str(int(r)): p for r, p in sorted(by_rate.items())},
    }


# --- fluxjoin bench move-cost: what one move costs, by mode and window size, against a restart ---


def move_cost_config(base: Config, pipeline: str, window_ms: int, rate: float, seconds: float) -> Config:
    """2-way, P = 16, 2 instances; keys sized for about one result per input tuple at this window.
    Polled every 0.1 s: a move's step starts at the next poll, not at the next trigger (decision 0027)."""
    per_stream = rate / 2
    return base.with_overrides(
        pipeline=pipeline,
        streams=["A", "B"],
        window_ms=window_ms,
        partitions=16,
        instances=2,
        **{
            "generator.mode": "real_time",
            "generator.duration_s": seconds,
            "generator.max_tuples": None,
            "generator.rate": {"kind": "constant", "rate": per_stream},
            "generator.keys": {"kind": "uniform", "count": max(256, int(per_stream * window_ms / 1000))},
            "instance.spark_master": "local[1]",
            "instance.shuffle_partitions": 1,
            "instance.trigger_ms": 500,
            "instance.poll_ms": 100,
        },
    )


def _pid_batches(records: list[dict[str, Any]], pid: int) -> list[tuple[float, str]]:
    """(batch end ms, instance) of every batch that read input of `pid`, in time order."""
    return sorted(
        (r["time_ms"], r["instance"]) for r in records if r["pids"].get(str(pid), {}).get("in", 0) > 0
    )


def pause_of(records: list[dict[str, Any]], pid: int, after_ms: float) -> float:
    """The longest gap between consecutive batches reading `pid` from `after_ms` on (seconds): the pid's
    pause across a move or a restart."""
    times = [t for t, _ in _pid_batches(records, pid) if t >= after_ms - 5000]
    gaps = [b - a for a, b in pairwise(times)]
    return round(max(gaps, default=0.0) / 1000, 2)


def batch_interval_s(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> float:
    """The median gap between consecutive batches reading a pid, over all pids, in [start_ms, end_ms):
    how often a pid's input is processed in steady state (the yardstick of a move's pause)."""
    gaps = []
    for pid in {int(p) for r in records for p in r["pids"]}:
        times = [t for t, _ in _pid_batches(records, pid) if start_ms <= t < end_ms]
        gaps += [b - a for a, b in pairwise(times)]
    return round(statistics.median(gaps) / 1000, 2) if gaps else 0.0


def to_target_s(records: list[dict[str, Any]], pid: int, target: str, after_ms: float) -> float | None:
    """Seconds from `after_ms` (the move's request) to the target's first batch reading `pid`."""
    first = [t for t, i in _pid_batches(records, pid) if i == target and t >= after_ms]
    return round((first[0] - after_ms) / 1000, 2) if first else None


def busy_per_s(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> float:
    """Seconds of micro-batch work per second of wall time, summed over the instances, in
    [start_ms, end_ms): the CPU a step costs, compared with the same figure in steady state."""
    work = sum(r["duration_s"] for r in records if start_ms <= r["time_ms"] < end_ms)
    return round(work / max((end_ms - start_ms) / 1000, 1e-3), 3)


def _acquired(log: Any, move_id: str) -> bool:
    return move_id in log.catch_up().acquired


def _settled(log: Any) -> bool:
    """No move in flight and no parallel track open: the assignment of record is at rest."""
    a = log.catch_up().assignment
    return a is not None and not (a.moving or a.handoffs or a.tracks or a.track_handoffs)


def p99_of_pids(
    records: list[dict[str, Any]], start_ms: float, end_ms: float, moved: int | None = None
) -> float | None:
    """The result-latency p99 of the batches in [start_ms, end_ms), from each pid's latency sample,
    leaving out the `moved` pid: how a move treats the pids it does not move."""
    samples = [
        p
        for r in records
        if start_ms <= r["time_ms"] < end_ms
        for pid, p in r["pids"].items()
        if int(pid) != moved and p.get("results")
    ]
    return weighted_percentiles(samples, (99,))[0]


MOVES_PER_MODE = 3
"""Moves of each mode per window size, there and back. One move's pause is one sample of a noisy machine
(six replays in one setting paused 0.59-0.92 s, decision 0038): the report gives each figure's median
over the moves, the longest pause and every move's figures."""


def medians_of(samples: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each key's median over the samples that have a value for it."""
    out: dict[str, float | None] = {}
    for key in samples[0]:
        values = [s[key] for s in samples if s[key] is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    return out


def ratio_to(value: float | None, steady: float | None) -> float | None:
    """`value` as a multiple of its steady-state figure, or None when either is unknown."""
    return round(value / steady, 2) if value is not None and steady else None


def spell_figures(records: list[dict[str, Any]], start_ms: float, end_ms: float) -> dict[str, Any]:
    """A quiet spell's yardsticks: the p99 of every pid, the batch interval and the work per second."""
    return {
        "p99_s": p99_of_pids(records, start_ms, end_ms),
        "batch_interval_s": batch_interval_s(records, start_ms, end_ms),
        "busy_per_s": busy_per_s(records, start_ms, end_ms),
    }


def measure_move_cost(
    cfg: Config, bootstrap: str, work: Path, steady_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """After the window has filled: `MOVES_PER_MODE` moves by transfer, by replay and by parallel track,
    then a restart of instance-0's query (the stop-the-world alternative).

    Each step is compared with the quiet spell just before it (decision 0039): a spell's p99 is about
    its slowest batch, and one steady spell measured minutes earlier drifted from the moves' spells by
    as much as the 1.2x the issue allows. A quiet spell begins once the previous move has settled (a
    parallel track stays open until the sender's old tuples have left the window)."""
    import signal

    from controller.moves import request_moves
    from controller.runner import instance_names
    from pipeline.control import ControlLog, wait_for
    from pipeline.protocol import Mode

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    log = ControlLog(bootstrap, cfg.control_topic)
    records: list[dict[str, Any]] = []
    spells: list[dict[str, Any]] = []

    def collect_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            records.extend(r for r in follower.poll() if r.get("kind") == "batch")
            pipeline.check_alive()

    def quiet_spell() -> dict[str, Any]:
        wait_for(partial(_settled, log), 120, "the previous move to settle")
        start = time.time() * 1000
        collect_for(steady_s)
        spells.append(spell_figures(records, start, time.time() * 1000))
        return spells[-1]

    out: dict[str, Any] = {}
    names = instance_names(2)
    try:
        warm_up: list[dict[str, Any]] = []
        start_warm(pipeline, follower, warm_up, "static")
        records.extend(r for r in warm_up if r.get("kind") == "batch")
        collect_for(cfg.window_ms / 1000 + 15)  # fill the window
        for pid, mode in ((0, Mode.TRANSFER), (1, Mode.REPLAY), (3, Mode.PARALLEL_TRACK)):
            moves: list[dict[str, Any]] = []
            for n in range(MOVES_PER_MODE):  # instance-0 to instance-1, back, and so on
                steady = quiet_spell()
                target = names[(n + 1) % 2]
                started = time.time() * 1000
                move_id = request_moves(cfg, bootstrap, [pid], target, mode).move_id(pid)
                wait_for(partial(_acquired, log, move_id), 120, f"the {mode.value} move")
                collect_for(steady_s)
                ended = time.time() * 1000
                others_p99 = p99_of_pids(records, started, ended, moved=pid)
                busy = busy_per_s(records, started, ended)
                moves.append(
                    {
                        "pause_s": pause_of(records, pid, started),
                        "to_target_s": to_target_s(records, pid, target, started),
                        "others_p99_s": others_p99,
                        "others_p99_x": ratio_to(others_p99, steady["p99_s"]),
                        "busy_per_s": busy,
                        "busy_x": ratio_to(busy, steady["busy_per_s"]),
                        "steady_p99_s": steady["p99_s"],
                    }
                )
                say(f"move-cost W={cfg.window_ms} ms {mode.value} move {n + 1}: {moves[-1]}")
            out[mode.value] = medians_of(moves) | {
                "pause_max_s": max(m["pause_s"] for m in moves),
                "others_p99_x_max": max((m["others_p99_x"] or 0.0) for m in moves),
                "moves": moves,
            }
        steady = quiet_spell()
        started = time.time() * 1000
        pipeline.kill(names[0], signal.SIGTERM)  # the global alternative: stop the query, start it again
        stopped = time.time() * 1000  # the old process has exited: a batch after this is the new one's
        pipeline.start_instance(names[0])
        deadline = time.monotonic() + 300
        while not any(t > stopped for t, _ in _pid_batches(records, 2)) and time.monotonic() < deadline:
            collect_for(1.0)  # until the restarted query reads pid 2 again
        collect_for(steady_s)
        others_p99 = p99_of_pids(records, started, time.time() * 1000)
        out["restart"] = {
            "pause_s": pause_of(records, 2, started),
            "others_p99_s": others_p99,
            "others_p99_x": ratio_to(others_p99, steady["p99_s"]),
        }
        say(f"move-cost W={cfg.window_ms} ms restart: {out['restart']}")
    finally:
        log.close()
        follower.close()
        pipeline.stop()
    out |= {f"steady_{k}": v for k, v in medians_of(spells).items()}  # the yardsticks of the quiet spells
    state = [
        sum(p["state_bytes"] for p in r["pids"].values()) for r in records if r["instance"] == "instance-0"
    ]
    out["state_bytes_instance0"] = max(state, default=0)
    return out


def run_move_cost_bench(
    cfg: Config,
    windows_ms: list[int],
    rate: float = 4000,
    steady_s: float = 15,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    from controller.kafka_runtime import broker_unless

    run_id, work = new_run(cfg, "move-cost")
    summary: dict[str, Any] = {}
    with broker_unless(cfg.bootstrap) as bootstrap:
        for w in windows_ms:
            # Fill, a quiet spell and a spell after each move, the restart's; parallel tracks settle.
            spells = 6 * MOVES_PER_MODE + 3
            seconds = w / 1000 + 15 + spells * steady_s + MOVES_PER_MODE * w / 1000 + 90
            c = move_cost_config(cfg, f"{run_id}-w{w}", w, rate, seconds)
            summary[str(w)] = measure_move_cost(c, bootstrap, work / f"w{w}", steady_s, say)
        drop_run_topics(bootstrap, run_id, say)
    save_report(run_id, "move_cost", summary, say)
    return summary


# --- fluxjoin bench convergence: how fast flux rebalances after a load shift, and whether it thrashes ---

BUCKET_S = 5.0
"""Busy fractions are compared over buckets this long (by batch end time)."""


def imbalance_series(records: list[dict[str, Any]], instances: list[str], start_ms: float) -> list[float]:
    """Per `BUCKET_S` bucket since `start_ms`: busiest over idlest instance's busy fraction, the policy's
    own measure (`controller.rounds.busy_fraction`) over the batches ending in the bucket. An instance
    with none keeps its last figure (it is inside a longer batch); before its first batch it reads 0.
    The idlest is floored at 0.01, so an idle instance reads as a large, finite imbalance."""
    from controller.rounds import busy_fraction

    buckets: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("kind") == "batch" and r["time_ms"] >= start_ms and r["instance"] in instances:
            index = int((r["time_ms"] - start_ms) / 1000 / BUCKET_S)
            buckets.setdefault(index, {}).setdefault(r["instance"], []).append(r)
    busy = dict.fromkeys(instances, 0.0)
    series = []
    for index in range(max(buckets, default=-1) + 1):
        for name, batches in buckets.get(index, {}).items():
            busy[name] = busy_fraction(batches)
        high, low = max(busy.values()), min(busy.values())
        series.append(round(high / max(0.01, low), 2) if high > 0 else 1.0)
    return series


@dataclass(frozen=True, slots=True)
class Round:
    """A flux round as the controller logged it: when (seconds since the input started), how many pids
    it moved, and whether it found the most and the least utilized instance within th_imb of each
    other: the policy's own verdict that the instances are balanced."""

    at_s: float
    moves: int
    balanced: bool


_ROUND_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d) policy flux: (no move|pid \d+ \S+ -> \S+) \((flux: .*)\)$")


_BALANCED = re.compile(r"flux: stopped at [^:;]+: U_d/U_r [\d.]+ < th_imb")
"""The reason of a round whose first pair, the most and the least utilized instance, is within th_imb:
balanced. A first pair that fails on th_util (the least utilized is busy too) is not."""


def rounds_of(log_lines: list[str], start: float) -> list[Round]:
    """The flux rounds in a controller log (`controller.cli` prefixes each line with the local time of
    day), timed from `start` (epoch seconds). A round logs one line per move, all with its reason, or one
    "no move" line when its reason changed (an unchanged reason is the same verdict)."""
    day = time.localtime(start)
    start_of_day = day.tm_hour * 3600 + day.tm_min * 60 + day.tm_sec + (start % 1)
    rounds: list[Round] = []
    last_reason = ""
    for line in log_lines:
        found = _ROUND_LINE.match(line)
        if not found:
            continue
        hours, minutes, seconds, what, reason = found.groups()
        at_s = int(hours) * 3600 + int(minutes) * 60 + int(seconds) - start_of_day
        at_s += 86400 if at_s < -43200 else 0  # past midnight
        if what == "no move":
            rounds.append(Round(at_s, 0, bool(_BALANCED.match(reason))))
        elif rounds and rounds[-1].moves and reason == last_reason:
            rounds[-1] = Round(rounds[-1].at_s, rounds[-1].moves + 1, False)
        else:
            rounds.append(Round(at_s, 1, False))
        last_reason = reason
    return rounds


def convergence_of(
    rounds: list[Round], shift_s: float, end_s: float, quiet_s: float = 20.0
) -> dict[str, Any]:
    """Moves per minute over the run; after the shift, the rounds that moved pids, and the rounds and
    seconds until balanced: until the first round after the shift's last moves that found the
    instances balanced by the policy's own test, at least `quiet_s` before the end, so that they
    stayed balanced that long (0 if the shift needed no move; None if no round did so: still moving,
    or left unbalanced). A round found balanced between moves does not count: the load it saw may not
    yet have been the shift's.
    `settle_s` is the time from the shift to the last move, if the moves stopped at least `quiet_s`
    before the end (else None: still moving)."""
    moves = sum(r.moves for r in rounds)
    after = [r for r in rounds if r.at_s >= shift_s]
    moved = [i for i, r in enumerate(after) if r.moves]
    point: dict[str, Any] = {
        "moves": moves,
        "moves_per_min": round(moves / (end_s / 60), 2),
        "rounds_after_shift": len(moved),
        "rounds_to_balance": 0,
        "balanced_s": 0.0,
        "settle_s": None if moved and after[moved[-1]].at_s > end_s - quiet_s else 0.0,
    }
    if not moved:
        return point
    if point["settle_s"] is not None:
        point["settle_s"] = round(after[moved[-1]].at_s - shift_s, 1)
    balanced = next((r for r in after[moved[-1] :] if r.balanced), None)
    if balanced is None or balanced.at_s > end_s - quiet_s:
        return point | {"rounds_to_balance": None, "balanced_s": None}
    return point | {"rounds_to_balance": len(moved), "balanced_s": round(balanced.at_s - shift_s, 1)}


CONVERGENCE_SERIES = ("imbalance_series", "rounds")
"""A convergence point's per-bucket and per-round listings, left out where a summary is printed."""


def measure_convergence(
    cfg: Config, bootstrap: str, work: Path, delta_min_s: float, shift_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """One flux run with `delta_min_s`, otherwise as the skew benchmark runs flux (several moves per
    pair, in FLUX_SKEW_MODE): the input's hot pids change at `shift_s` (and at its multiples)."""
    from controller.runner import instance_names

    pipeline = LocalPipeline(cfg, bootstrap, work)
    follower = MetricsFollower(pipeline.cfg, bootstrap)
    names = instance_names(cfg.instances)
    records: list[dict[str, Any]] = []
    try:
        params = flux_skew_params(cfg.instance.trigger_ms) | {
            "delta_min_s": delta_min_s,
            "delta_s": max(1.0, delta_min_s),
        }
        start_warm(pipeline, follower, records, "flux", params, FLUX_SKEW_MODE)
        start = time.time()
        follow_input(pipeline, follower, records)
        end_s = time.time() - start
        records.extend(_drain(follower))
    finally:
        follower.close()
        pipeline.stop()
    rounds = rounds_of((work / "controller.log").read_text().splitlines(), start)
    series = imbalance_series(records, names, start * 1000)
    before = series[max(0, int((shift_s - 20) / BUCKET_S)) : int(shift_s / BUCKET_S)]
    last = series[-int(20 / BUCKET_S) - 1 : -1]  # the final bucket is partial
    point = {
        **convergence_of(rounds, shift_s, end_s),
        "imbalance_before_shift": round(statistics.median(before), 2) if before else None,
        "imbalance_at_end": round(statistics.median(last), 2) if last else None,
        "imbalance_series": series,
        "rounds": [[round(r.at_s, 1), r.moves, r.balanced] for r in rounds],
    }
    shown = {k: v for k, v in point.items() if k not in CONVERGENCE_SERIES}
    say(f"convergence: delta_min {delta_min_s:g} s: {shown}")
    return point


def run_convergence_bench(
    cfg: Config,
    delta_mins: list[float],
    rate: float = 2000,
    shift_s: float = 90,
    instances: int = 4,
    cpu: float = 0.25,
    key_seconds: float = 1.0,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Flux after a load shift, once per delta_min (the Flux paper's Fig. 9 sweep), in one run; the
    defaults are the skew benchmark's setting at a rate both policies sustain there."""
    from controller.kafka_runtime import broker_unless

    run_id, work = new_run(cfg, "convergence")
    summary: dict[str, Any] = {}
    with broker_unless(cfg.bootstrap) as bootstrap:
        idle_s = measure_idle_batch_s(cfg, bootstrap, run_id, work, rate, instances, cpu, key_seconds, say)
        trigger_ms = skew_trigger_ms(idle_s)
        for delta_min in delta_mins:
            name = f"{run_id}-d{delta_min:g}".replace(".", "p")
            c = skew_config(cfg, name, rate, 2 * shift_s, instances, cpu, key_seconds, trigger_ms, shift_s)
            summary[f"{delta_min:g}"] = measure_convergence(
                c, bootstrap, work / name, delta_min, shift_s, say
            )
        drop_run_topics(bootstrap, run_id, say)
    save_report(run_id, "convergence", summary, say)
    return summary
