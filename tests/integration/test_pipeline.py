"""End to end on a real broker: generator -> instance processes (Spark) -> results, checked by the oracle."""

from __future__ import annotations

import itertools
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from generator.producer import run_generator
from local.processes import LocalPipeline, backlog, committed_offsets, wait_drained
from pipeline.codec import encode_tuples
from pipeline.config import Config, load_config
from pipeline.control import wait_for
from pipeline.oracle import verify_pipeline
from pipeline.partitioning import pids_of
from pipeline.topics import read_topic


def small_config(prefix: str, *extra: str) -> Config:
    return load_config(
        None,
        [
            f"pipeline={prefix}",
            "streams=[A, B]",
            "partitions=8",
            "window_ms=2000",
            "allowed_lateness_ms=1000",
            "generator.mode=max_rate",
            "generator.rate={kind: constant, rate: 3000}",
            "generator.keys={kind: uniform, count: 4000}",
            "generator.tuples_per_message=64",
            "instance.trigger_ms=200",
            "instance.max_rows_per_batch=20000",
            "instance.spark_master=local[1]",
            "instance.shuffle_partitions=1",
            *extra,
        ],
    )


def wait_until(
    pipeline: LocalPipeline, ok: Callable[[], bool], timeout_s: float, what: str, poll_s: float
) -> None:
    """`wait_for` that fails at once, with the log's tail, if a process of the pipeline crashed."""

    def ok_while_alive() -> bool:
        if ok():
            return True
        pipeline.check_alive()
        return False

    wait_for(ok_while_alive, timeout_s, what, poll_s)


def drain_with_one_instance(cfg: Config, bootstrap: str, work: Path) -> LocalPipeline:
    """Run one instance owning all 8 pids until it has read all the input there is, then stop it."""
    pipeline = LocalPipeline(cfg, bootstrap, work)
    try:
        pipeline.start_instance("instance-0", range(0, 8))
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    return pipeline


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """An instance's /metrics: sample name and labels -> value."""
    code, body = _get(port, "/metrics")
    assert code == 200, body
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def test_two_instances_on_a_static_split_produce_exactly_the_oracle(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Also what each instance serves on a metrics port of its own: ready once its query runs, and
    metrics that count every input tuple and every result once between them."""
    cfg = small_config(topic_prefix, "generator.max_tuples=60000", "generator.duration_s=null")
    run_generator(cfg, kafka_bootstrap)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    ports = {"instance-0": _free_port(), "instance-1": _free_port()}
    try:
        pipeline.start_instance("instance-0", range(0, 4), metrics_port=ports["instance-0"])
        pipeline.start_instance("instance-1", range(4, 8), metrics_port=ports["instance-1"])
        wait_drained(pipeline, timeout_s=300)
        probes = {name: (_get(port, "/healthz"), _get(port, "/readyz")) for name, port in ports.items()}

        def tuples_counted() -> float:  # a batch's metrics are taken in just after its commit
            return sum(_scrape(port)[("fluxjoin_instance_tuples_total", ())] for port in ports.values())

        wait_for(lambda: tuples_counted() >= 60000, 30, "the last batches' metrics", 0.5)
        scraped = {name: _scrape(port) for name, port in ports.items()}
    finally:
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.input_tuples == 60000
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()

    assert probes == {name: ((200, "running\n"), (200, "serving\n")) for name in ports}
    assert sum(m[("fluxjoin_instance_tuples_total", ())] for m in scraped.values()) == 60000
    assert sum(m[("fluxjoin_instance_results_total", ())] for m in scraped.values()) == report.expected
    for name, pids in (("instance-0", range(0, 4)), ("instance-1", range(4, 8))):
        m = scraped[name]
        assert m[("fluxjoin_instance_ready", ())] == 1
        assert m[("fluxjoin_instance_pids", ())] == 4
        lag = {
            dict(labels)["pid"]: v for (n, labels), v in m.items() if n == "fluxjoin_instance_lag_messages"
        }
        assert lag == {str(p): 0 for p in pids}, "drained: nothing beyond the last batch"
        assert m[("fluxjoin_instance_state_bytes", ())] > 0
        batches = m[("fluxjoin_instance_batches_total", ())]
        assert batches >= 1 and m[("fluxjoin_instance_batch_duration_seconds_count", ())] == batches
        results = m[("fluxjoin_instance_results_total", ())]
        assert m[("fluxjoin_instance_result_latency_seconds_count", ())] == results > 0


def test_a_paced_instance_runs_its_batches_a_trigger_apart_and_stays_exact(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """A 3 s trigger polled every 0.5 s (decision 0027): the source answers the polls between batches
    with its start offset, which must make Spark run no batch then. Every batch must start a trigger
    (less half a poll) after the one before, over a backlog that takes several batches, and the output
    must be exact. Each batch's metrics count its results per pid (the memory policy's P_o).
    A batch starts when Spark logs its offsets, right after the source names them: the sink's own start
    comes after query planning, whose time varies by a few tenths of a second from batch to batch."""
    cfg = small_config(
        topic_prefix,
        "generator.max_tuples=60000",
        "generator.duration_s=null",
        "instance.trigger_ms=3000",
        "instance.poll_ms=500",
    )
    run_generator(cfg, kafka_bootstrap)
    pipeline = drain_with_one_instance(cfg, kafka_bootstrap, tmp_path)
    records = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.metrics_topic)]
    batches = [r for r in records if r.get("kind") == "batch"]
    offset_log = tmp_path / cfg.pipeline / "instance-0" / "checkpoint" / "offsets"
    starts = sorted(f.stat().st_mtime for f in offset_log.iterdir() if f.name.isdigit())
    assert len(starts) >= 3, f"the backlog must take several batches, got {len(starts)}"
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert min(gaps) > 2.5, f"batches closer than a trigger: {gaps}"
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 10_000
    assert report.exact, report.describe()
    per_pid = [sum(s["results"] for s in b["pids"].values()) for b in batches]
    assert per_pid == [b["results"] for b in batches], "a batch's per-pid result counts add up to its own"
    assert sum(per_pid) == report.expected
    beats = [r for r in records if r.get("kind") == "heartbeat"]
    said = [(b["batch"], b["progress_ms"]) for b in beats]
    assert said == sorted(said), "a heartbeat's progress never goes back"
    assert {b for b, _ in said} <= {-1} | {b["batch"] for b in batches}, "it names batches the query ran"
    assert said[-1][0] >= 0 and all(t <= b["time_ms"] for (_, t), b in zip(said, beats, strict=True))


def test_three_way_join_is_exact(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> None:
    cfg = small_config(
        topic_prefix,
        "streams=[A, B, C]",
        "generator.max_tuples=30000",
        "generator.duration_s=null",
        "generator.keys={kind: uniform, count: 3000}",  # ~72K results
    )
    run_generator(cfg, kafka_bootstrap)
    pipeline = drain_with_one_instance(cfg, kafka_bootstrap, tmp_path)
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 1_000
    assert report.exact, report.describe()


def test_kill_minus_nine_and_restart_stays_exact(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """An instance killed mid-run resumes from its checkpoint; its sink skips or redoes batches so the
    results topic still holds each result once."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=40",
        "generator.rate={kind: constant, rate: 1000}",
    )
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        pipeline.start_instance("instance-0", range(0, 4))
        pipeline.start_instance("instance-1", range(4, 8))
        pipeline.start_generator()
        wait_until(
            pipeline,
            lambda: any(
                k[1] < 4 and v > 0 for k, v in committed_offsets(pipeline.cfg, kafka_bootstrap).items()
            ),
            180,
            "instance-0's first committed batch",
            poll_s=1,
        )
        time.sleep(3)
        pipeline.kill("instance-0", signal.SIGKILL)
        time.sleep(3)
        pipeline.start_instance("instance-0", range(0, 4))
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 1_000
    assert report.exact, report.describe()


def test_a_batch_in_kafka_but_not_in_the_commit_log_runs_again_without_output(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The crash window between the sink's Kafka commit and Spark's commit-log entry, made exact: an idle
    instance is killed and its last commit-log entry removed. On restart Spark re-runs that batch; the
    sink must run it (its state stores must commit) without writing its output a second time."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=60",
        "generator.rate={kind: steps, steps: [[0, 1000], [10, 0], [50, 1000]]}",
    )
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    commits = tmp_path / cfg.pipeline / "instance-0" / "checkpoint" / "commits"
    offsets = commits.parent / "offsets"

    def newest(log: Path) -> int:
        return max((int(f.name) for f in log.iterdir() if f.name.isdigit()), default=-1)

    try:
        pipeline.start_instance("instance-0", range(0, 8))
        pipeline.wait_running(["instance-0"])
        pipeline.start_generator()
        time.sleep(12)  # into the generator's quiet phase
        wait_until(
            pipeline,
            lambda: backlog(pipeline.cfg, kafka_bootstrap) == 0 and newest(commits) == newest(offsets) >= 0,
            60,
            "instance-0 to go idle in the quiet phase",
            poll_s=0.5,
        )
        pipeline.kill("instance-0", signal.SIGKILL)
        last = newest(commits)
        (commits / str(last)).unlink()
        pipeline.start_instance("instance-0", range(0, 8))
        # Looked for as soon as it is due: the commit log keeps only the newest batches.
        wait_until(pipeline, (commits / str(last)).exists, 120, "the batch to run again", poll_s=0.2)
        assert pipeline.procs["generator"].wait(120) == 0, pipeline.log_tail("generator")
        wait_drained(pipeline, timeout_s=300)
    finally:
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 1_000
    assert report.exact, report.describe()


def test_malformed_records_go_to_the_dead_letter_topic_with_a_reason(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Garbage, a tombstone (no value: it killed the instance on every restart), an empty value, an
    unknown schema version, a key of another pid and a negative id: each is dead-lettered with its
    reason, the instance runs on, and the oracle counts them as malformed as the instances do. A good
    record of the broker's largest default size among them is joined."""
    cfg = small_config(topic_prefix, "generator.max_tuples=5000", "generator.duration_s=null")
    run_generator(cfg, kafka_bootstrap)
    one = np.array([10_000_000], dtype=np.int64)
    no_payload = np.zeros((1, 0), np.uint8)
    key_of_pid = {int(pids_of(np.array([k]), cfg.partitions)[0]): k for k in range(100)}
    other_pid = np.array([key_of_pid[4]], dtype=np.int64)  # written to partition 3
    own_key = np.array([key_of_pid[3]], dtype=np.int64)
    version_2 = bytearray(encode_tuples(one, own_key, one, no_payload))
    version_2[0] = 2
    bad: list[bytes | None] = [
        b"\x07garbage",
        None,
        b"",
        bytes(version_2),
        encode_tuples(one, other_pid, one, no_payload),
        encode_tuples(-one, own_key, one, no_payload),
    ]
    # And a good record as large as the broker takes by default (1 MB): ten tuples with 100 KB of
    # payload each, which the join never looks at; it is accepted like any other (not dead-lettered).
    ten = np.arange(10_000_001, 10_000_011, dtype=np.int64)
    after_all = np.full(10, 4 * 10**12, dtype=np.int64)  # event times past the generator's: not late
    large = encode_tuples(ten, np.repeat(own_key, 10), after_all, np.ones((10, 100_000), np.uint8))
    assert 1_000_000 < len(large) < 1_048_000
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 1_048_588})
    for value in [*bad, large]:
        producer.produce(cfg.input_topic("A"), value=value, partition=3, key=b"3")
    producer.flush(30)
    pipeline = drain_with_one_instance(cfg, kafka_bootstrap, tmp_path)
    dead = [json.loads(v) for _, _, v in read_topic(kafka_bootstrap, cfg.dead_letter_topic)]
    assert [d["reason"] for d in dead] == [
        "malformed: truncated",
        "malformed: truncated",
        "malformed: truncated",
        "malformed: unknown_version",
        "malformed: wrong_partition",
        "malformed: negative_id",
    ]
    assert {(d["topic"], d["partition"]) for d in dead} == {(cfg.input_topic("A"), 3)}
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.malformed == len(bad)
    assert report.exact, report.describe()


def test_an_instance_whose_jvm_runs_out_of_memory_exits_instead_of_hanging(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """One key, 4,000 tuples a stream within W: one batch of 16 million results, more than a 512 MB
    driver holds. An instance that lived on without its JVM, or with a dead Spark thread, would never
    finish the batch and would go on heart-beating; it must exit, so that the controller recovers its
    pids."""
    cfg = small_config(
        topic_prefix,
        "generator.max_tuples=8000",
        "generator.duration_s=null",
        "generator.keys={kind: uniform, count: 1}",
        "instance.driver_memory=512m",
    )
    run_generator(cfg, kafka_bootstrap)
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        pipeline.start_instance("instance-0", range(0, 8))
        code = pipeline.procs["instance-0"].wait(timeout=600)
    finally:
        pipeline.stop()
    log = (tmp_path / "instance-0.log").read_text(errors="replace")
    assert code == 1, pipeline.log_tail("instance-0", 40)
    assert "OutOfMemory" in log and "Spark's JVM is gone" in log, pipeline.log_tail("instance-0", 40)


def test_an_instances_jvm_exits_on_any_out_of_memory_error() -> None:
    """An OutOfMemoryError in a thread without Spark's exit handler (the task-result getter, collecting
    a batch's results on the heap) leaves the JVM running with the batch unfinished for ever; the
    instance's JVM must run with the option that ends it on any OutOfMemoryError."""
    script = (
        "from pipeline.config import load_config; from pipeline.instance import spark_session; "
        "spark = spark_session(load_config(None), 'jvm-options'); "
        "bean = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean(); "
        "print(list(bean.getInputArguments())); spark.stop()"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "-XX:+ExitOnOutOfMemoryError" in done.stdout
