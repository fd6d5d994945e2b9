"""`fluxjoin bench peers`: one fluxjoin instance against Apache Flink's interval join, side by side.

Flink is the baseline a user would reach for instead: its Kafka source, `keyBy` and interval join
[-W, +W] (the same join condition, |tA - tB| <= W on equal keys), its Kafka sink in transactions. The job
(`bench/flink/`, Java, Flink 2.2.1 and the Kafka connector 5.0.0-2.2 from Maven Central) is built with
Maven into the cache on first use and runs in one JVM on a local MiniCluster with parallelism 2, the
machine's 2 cores, as fluxjoin runs `local[2]`. State in the heap backend (`hashmap`), checkpoints to the
file system every second, exactly-once: its results become visible to a read_committed reader when the
checkpoint after them completes, as fluxjoin's do when its batch's transaction commits.

In one run, on one broker, one engine at a time:

(a) Catch-up rate. The input of `bench throughput` is pre-loaded once; fluxjoin reads it (timed from the
    start of its first batch to the end of its last), then Flink reads the same topics bounded at their
    end offsets (timed from its first decoded tuple to the end of the job, after its last commit: the
    JVM's and the MiniCluster's start-up excluded, as Spark's is for fluxjoin). Both outputs are judged
    by the oracle.
(b) Result latency at a fixed real-time rate, for each engine on its own pipeline's topics: a
    read_committed reader follows the results topic, and a result's latency is the time the reader gets
    it minus its max event time (the generator's event time is its wall clock), over the results whose
    event time lies more than `WARM_UP_S` after the run's first. fluxjoin's own metric (taken just
    before its commit) is reported beside it. Both outputs are judged by the oracle.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.run import bench_run, ratio_to, save_report
from bench.throughput import catchup_config, latency_config, measure_fluxjoin, measure_latency
from pipeline.config import Config
from pipeline.oracle import VerifyReport

FLINK_PROJECT = Path(__file__).with_name("flink")
MAIN_CLASS = "io.fluxjoin.bench.IntervalJoinJob"
JAR = "fluxjoin-flink-baseline-1.jar"  # the artifact bench/flink/pom.xml builds
CHECKPOINT_MS = 1000
"""Flink's checkpoint interval: with an exactly-once Kafka sink, how often its results become visible,
so the latency a user would tune it for (fluxjoin's trigger is 500 ms)."""
RESULTS_PER_MESSAGE = 1024
"""Results packed into one Kafka message by the Flink job (fluxjoin's results topic carries batches)."""
JVM_OPTIONS = ("-Xms3g", "-Xmx3g", "-XX:+UseG1GC")
WARM_UP_S = 15.0
QUIET_S = 5.0
"""A results topic without a new message for this long after the input ended has all its results."""


def flink_classpath(say: Callable[[str], None]) -> list[Path]:
    """The job's jar and its runtime dependencies, built with Maven into the cache on first use: one
    directory per hash of the job's sources, so an edited job is never run from a stale build."""
    from local.kafka_dist import cache_dir, locked

    sources = sorted(p for p in FLINK_PROJECT.rglob("*") if p.is_file() and "target" not in p.parts)
    digest = hashlib.sha256()
    for p in sources:
        digest.update(str(p.relative_to(FLINK_PROJECT)).encode() + b"\0" + p.read_bytes())
    root = cache_dir() / "flink" / digest.hexdigest()[:12]
    if not (root / "complete").is_file():
        with locked(root.parent / f"{root.name}.lock"):
            if not (root / "complete").is_file():
                _build(root, cache_dir() / "kafka" / "m2", say)
    return sorted((root / "libs").glob("*.jar"))


def _build(root: Path, repository: Path, say: Callable[[str], None]) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("no `mvn` found: the Flink baseline is built with Maven (apt-get install maven)")
    src, partial = root / "src", root / "libs.partial"
    for stale in (src, partial, root / "libs"):
        shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(FLINK_PROJECT, src, ignore=shutil.ignore_patterns("target"))
    say("building the Flink baseline with Maven (first run only) ...")
    cmd = [
        mvn, "-B", "-q", "-f", str(src / "pom.xml"), f"-Dmaven.repo.local={repository}",
        "package", "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=src)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"Maven could not build the Flink baseline:\n{tail}")
    shutil.copy(src / "target" / JAR, partial / JAR)
    partial.rename(root / "libs")
    (root / "complete").write_text("\n".join(sorted(p.name for p in (root / "libs").glob("*.jar"))) + "\n")


@dataclass(frozen=True)
class FlinkJob:
    """One run of the Flink job: its topics, the join's W and lateness, and whether it reads the input
    up to the end offsets at its start and finishes (`bounded`) or runs until it is stopped."""

    bootstrap: str
    inputs: tuple[str, str]
    results: str
    window_ms: int
    lateness_ms: int
    bounded: bool
    checkpoint_dir: Path
    txn_prefix: str
    parallelism: int = 2
    checkpoint_ms: int = CHECKPOINT_MS
    batch: int = RESULTS_PER_MESSAGE
    rescale_to: int = 0
    """Above 0: once `rescale_signal` exists, stop with a savepoint and restart at this parallelism."""
    rescale_signal: Path | None = None
    savepoint_dir: Path | None = None

    @classmethod
    def of(cls, cfg: Config, bootstrap: str, results: str, work: Path, bounded: bool) -> FlinkJob:
        """The job on a 2-way pipeline's input topics, join settings and name, writing to `results`,
        with its checkpoints under `work`."""
        return cls(
            bootstrap,
            (cfg.input_topic(cfg.streams[0]), cfg.input_topic(cfg.streams[1])),
            results,
            cfg.window_ms,
            cfg.allowed_lateness_ms,
            bounded=bounded,
            checkpoint_dir=work / "flink-checkpoints",
            txn_prefix=f"{cfg.pipeline}-flink",
        )

    def rescaled(self, parallelism: int, signal: Path, savepoint_dir: Path) -> FlinkJob:
        """The job that rescales to `parallelism` by stop-with-savepoint once the file `signal` exists."""
        return replace(self, rescale_to=parallelism, rescale_signal=signal, savepoint_dir=savepoint_dir)

    def command(self, java: str, classpath: Sequence[Path]) -> list[str]:
        args: dict[str, object] = {
            "bootstrap": self.bootstrap,
            "left": self.inputs[0],
            "right": self.inputs[1],
            "results": self.results,
            "window-ms": self.window_ms,
            "lateness-ms": self.lateness_ms,
            "bounded": str(self.bounded).lower(),
            "parallelism": self.parallelism,
            "checkpoint-ms": self.checkpoint_ms,
            "checkpoint-dir": self.checkpoint_dir.resolve(),
            "batch": self.batch,
            "txn-prefix": self.txn_prefix,
        }
        if self.rescale_to:
            assert self.rescale_signal is not None and self.savepoint_dir is not None
            args |= {
                "rescale-to": self.rescale_to,
                "rescale-signal": self.rescale_signal.resolve(),
                "savepoint-dir": self.savepoint_dir.resolve(),
            }
        flags = [item for name, value in args.items() for item in (f"--{name}", str(value))]
        return [java, *JVM_OPTIONS, "-cp", ":".join(str(j) for j in classpath), MAIN_CLASS, *flags]


def markers(lines: Iterable[str]) -> dict[str, int]:
    """The job's `<name>-ms <epoch ms>` lines (running, first-record, done) by name."""
    found = {}
    for line in lines:
        name, _, value = line.strip().partition("-ms ")
        if value.isdigit():
            found[name] = int(value)
    return found


class FlinkProcess:
    """The job's JVM, its output in `work`; stopped (SIGTERM, then SIGKILL) when the `with` ends."""

    def __init__(self, job: FlinkJob, classpath: Sequence[Path], work: Path) -> None:
        from local.kafka_dist import java_executable

        work.mkdir(parents=True, exist_ok=True)
        self.out, self.err = work / "flink.out", work / "flink.err"
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(job.command(java_executable(), classpath), stdout=out, stderr=err)

    def __enter__(self) -> FlinkProcess:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def markers(self) -> dict[str, int]:
        return markers(self.out.read_text().splitlines())

    def wait_for(self, name: str, timeout_s: float) -> int:
        """The time of marker `name`, once the job has printed it; raise if it exits or times out first."""
        deadline = time.monotonic() + timeout_s
        while name not in (found := self.markers()):
            if self.proc.poll() is not None:
                tail = "\n".join(self.err.read_text().splitlines()[-20:])
                raise RuntimeError(f"the Flink job exited ({self.proc.returncode}) before `{name}`:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Flink job printed no `{name}` within {timeout_s:.0f} s")
            time.sleep(0.2)
        return found[name]


def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    from confluent_kafka.admin import NewTopic

    from pipeline.topics import admin_client

    admin = admin_client(bootstrap)  # kept until the creation has finished
    admin.create_topics([NewTopic(name, partitions)])[name].result()


def verify_flink(cfg: Config, bootstrap: str, results_topic: str) -> VerifyReport:
    """The oracle's report on Flink's results for `cfg`'s input. Flink reports no late tuples: none are
    late in this input, and any that were would show as late but unreported."""
    from pipeline.oracle import judge, read_inputs, result_ids
    from pipeline.topics import read_records

    inputs, malformed = read_inputs(cfg, bootstrap)
    return judge(
        inputs,
        result_ids(v for _, _, v in read_records(bootstrap, results_topic)),
        [np.empty(0, np.int64) for _ in cfg.streams],
        window_ms=cfg.window_ms,
        lateness_ms=cfg.allowed_lateness_ms,
        partitions=cfg.partitions,
        malformed=malformed,
    )


def measure_flink(
    cfg: Config, bootstrap: str, work: Path, classpath: Sequence[Path], say: Callable[[str], None]
) -> dict[str, Any]:
    """Flink reads the pre-loaded topics up to their end offsets and finishes; the oracle judges."""
    results = f"{cfg.pipeline}.flink-results"
    create_topic(bootstrap, results, cfg.partitions)
    job = FlinkJob.of(cfg, bootstrap, results, work, bounded=True)
    with FlinkProcess(job, classpath, work / "flink") as flink:
        done = flink.wait_for("done", timeout_s=1800)
        first = flink.markers()["first-record"]
    span = (done - first) / 1000
    report = verify_flink(cfg, bootstrap, results)
    tuples = report.input_tuples
    verdict = "exact" if report.exact else f"NOT EXACT\n{report.describe()}"
    say(f"flink: {tuples:,} tuples in {span:.1f} s -> {tuples / span:,.0f} tuples/s; oracle: {verdict}")
    return {
        "tuples": tuples,
        "seconds": round(span, 2),
        "tuples_per_s": round(tuples / span, 1),
        "results": report.produced,
        "exact": report.exact,
    }


class ResultWatch:
    """A read_committed reader of a results topic from its start, in a thread: for each message the
    time it was read and its results' max event times (`seen`), and their keys (`keys`, in step)."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        from pipeline.kafka_client import CONSUMER_GROUP, kafka_config

        self.consumer = Consumer(
            kafka_config(bootstrap)
            | {
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 50,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.seen: list[tuple[float, npt.NDArray[np.int64]]] = []
        self.keys: list[npt.NDArray[np.int64]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        from pipeline.codec import decode_results

        while not self.stop.is_set():
            msg = self.consumer.poll(0.1)
            value = None if msg is None or msg.error() is not None else msg.value()
            if value:
                batch = decode_results(value)
                self.keys.append(batch.keys.copy())
                self.seen.append((time.time(), batch.max_event_times.copy()))

    def wait_quiet(self, timeout_s: float = 300) -> None:
        """Return once no message has come for `QUIET_S` seconds: the engine has caught up."""
        deadline = time.monotonic() + timeout_s
        count = -1
        while count != len(self.seen) and time.monotonic() < deadline:
            count = len(self.seen)
            time.sleep(QUIET_S)

    def close(self) -> list[tuple[float, npt.NDArray[np.int64]]]:
        self.stop.set()
        self.thread.join()
        self.consumer.close()
        return self.seen


def latency_percentiles(
    seen: Sequence[tuple[float, npt.NDArray[np.int64]]], warm_up_s: float = WARM_UP_S
) -> tuple[float | None, float | None, int]:
    """p50 and p99 of read time minus max event time (seconds), over the results whose max event time
    lies more than `warm_up_s` after the earliest one; and how many results that is."""
    if not seen:
        return None, None, 0
    read = np.concatenate([np.full(len(t), at) for at, t in seen])
    event_s = np.concatenate([t for _, t in seen]) / 1000
    steady = event_s >= event_s.min() + warm_up_s
    if not steady.any():
        return None, None, 0
    p50, p99 = np.percentile(read[steady] - event_s[steady], (50, 99))
    return round(float(p50), 3), round(float(p99), 3), int(steady.sum())


def watched_latency(
    cfg: Config, bootstrap: str, run: Callable[[ResultWatch], None], say: Callable[[str], None], name: str
) -> dict[str, Any]:
    """Run an engine on `cfg` while a reader follows its results topic (`run` returns once the input
    has ended and the reader has been quiet); the percentiles and the oracle's verdict on its output."""
    from pipeline.oracle import verify_pipeline
    from pipeline.topics import ensure_topics

    ensure_topics(cfg, bootstrap)
    watch = ResultWatch(bootstrap, cfg.results_topic, cfg.partitions)
    try:
        run(watch)
    finally:
        seen = watch.close()
    p50, p99, n = latency_percentiles(seen)
    report = verify_pipeline(cfg, bootstrap)
    say(f"{name} latency: p50 {p50} s, p99 {p99} s over {n:,} results; exact: {report.exact}")
    return {"latency_p50_s": p50, "latency_p99_s": p99, "results": n, "exact": report.exact}


def run_flink_unbounded(
    cfg: Config, bootstrap: str, work: Path, classpath: Sequence[Path]
) -> Callable[[ResultWatch], None]:
    """The Flink side of (b): the job on `cfg`'s topics, then the generator in real time."""
    from generator.producer import run_generator

    def run(watch: ResultWatch) -> None:
        job = FlinkJob.of(cfg, bootstrap, cfg.results_topic, work, bounded=False)
        with FlinkProcess(job, classpath, work / "flink") as flink:
            flink.wait_for("running", timeout_s=120)
            run_generator(cfg, bootstrap)
            watch.wait_quiet()
            if flink.proc.poll() is not None:
                raise RuntimeError(f"the Flink job exited early; see {flink.err}")

    return run


def alternated(engines: Sequence[str], repeat: int) -> Sequence[str]:
    """The engines in their order on even repeats and reversed on odd ones, so that a machine whose
    load rises or falls during a run favours neither engine's median."""
    return engines[::-1] if repeat % 2 else engines


def loaded(measured: dict[str, Any]) -> dict[str, Any]:
    """A measurement with the machine's 1-minute load average at its end: other work on the machine
    shows in the report, next to the numbers it depressed."""
    return measured | {"load_1m": round(os.getloadavg()[0], 2)}


def run_peers_bench(
    cfg: Config,
    tuples: int = 2_000_000,
    repeats: int = 1,
    latency_rate: float = 20_000,
    latency_s: float = 60,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Catch-up of both engines `repeats` times on the same input, then latency of each once; the
    summary (medians, ratios, every run) is also written under reports/bench/."""
    from generator.producer import run_generator

    classpath = flink_classpath(say)
    ours, flink = [], []
    with bench_run(cfg, "peers", say) as run:
        for i in range(repeats):
            c = catchup_config(cfg, f"{run.run_id}-catchup-{i}", tuples)
            work = run.work / f"catchup-{i}"
            say(f"[{i + 1}/{repeats}] pre-loading {tuples:,} tuples into {', '.join(c.input_topics)}")
            run_generator(c, run.bootstrap)
            for engine in alternated(("fluxjoin", "flink"), i):
                if engine == "fluxjoin":
                    ours.append(loaded(measure_fluxjoin(c, run.bootstrap, work, say)))
                else:
                    flink.append(loaded(measure_flink(c, run.bootstrap, work, classpath, say)))
        lat = latency_config(cfg, f"{run.run_id}-latency", latency_rate, latency_s)
        own: dict[str, Any] = {}

        def fluxjoin_latency(watch: ResultWatch) -> None:
            own.update(measure_latency(lat, run.bootstrap, run.work / "latency", say))
            watch.wait_quiet()

        ours_lat = loaded(watched_latency(lat, run.bootstrap, fluxjoin_latency, say, "fluxjoin"))
        ours_lat["own_metric"] = own
        flink_cfg = latency_config(cfg, f"{run.run_id}-latency-flink", latency_rate, latency_s)
        flink_run = run_flink_unbounded(flink_cfg, run.bootstrap, run.work / "latency-flink", classpath)
        flink_lat = loaded(watched_latency(flink_cfg, run.bootstrap, flink_run, say, "flink"))
    ours_rate = statistics.median(r["tuples_per_s"] for r in ours)
    flink_rate = statistics.median(r["tuples_per_s"] for r in flink)
    summary = {
        "tuples_per_s": ours_rate,
        "flink_tuples_per_s": flink_rate,
        "ratio": ratio_to(ours_rate, flink_rate),
        "latency_p50_s": ours_lat["latency_p50_s"],
        "latency_p99_s": ours_lat["latency_p99_s"],
        "flink_latency_p50_s": flink_lat["latency_p50_s"],
        "flink_latency_p99_s": flink_lat["latency_p99_s"],
        "exact": all(r["exact"] for r in ours) and ours_lat["exact"],
        "flink_exact": all(r["exact"] for r in flink) and flink_lat["exact"],
        "tuples": tuples,
        "repeats": repeats,
        "latency_rate": latency_rate,
        "latency_seconds": latency_s,
        "flink_checkpoint_ms": CHECKPOINT_MS,
        "runs": {"fluxjoin": ours, "flink": flink, "latency": ours_lat, "flink_latency": flink_lat},
    }
    save_report(run.run_id, "peers", summary, say)
    return summary
