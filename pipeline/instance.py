"""A join instance: one Spark application running one Structured Streaming query.

source (assigned pids from Kafka) -> groupBy(pid).applyInPandasWithState(join) -> exactly-once sink.
The instance's durable state is its work directory: the Spark checkpoint (offset log, commit log,
state store), its incarnation id and the assignment file the source reads at every batch boundary.
Restarting with the same name and work directory resumes exactly where the last committed batch ended,
unless the controller declared the instance dead meanwhile (its pids were recovered elsewhere): then
the work directory is wiped and the instance rejoins empty, under a new incarnation.

Pids come from the control topic (`<pipeline>.control`) once a controller has published an assignment;
`--pids` gives a static assignment for pipelines run without a controller.

With a metrics port, the instance serves /metrics, /healthz and /readyz there (`pipeline.health`) from
its start, so that a pod's probes see it wait, start and run.

A query stopped by a full disk (its checkpoint or the sink's files beside it) is started again from its
checkpoint once the disk has room, in the same process; meanwhile the instance says so in its log and is
not ready (decision 0053).

With `instance.drain_timeout_s`, a SIGTERM does not stop the instance at once: it stays up, not ready,
while the operator moves its pids to the other instances, and stops once it holds none or the timeout
has passed (decision 0056).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.batch_metrics import BatchRecord
from pipeline.batch_timings import BatchTimingsLog
from pipeline.config import Config
from pipeline.executors import driver_conf
from pipeline.health import STALL_TIMEOUT_S, InstanceHealth, InstanceMetrics, Phase, serve
from pipeline.instance_files import OwnedPids, read_assignment, write_assignment

if TYPE_CHECKING:
    from pipeline.sink import ExactlyOnceSink

log = logging.getLogger(__name__)


def parse_pids(spec: str, partitions: int) -> frozenset[int]:
    """'0-15,20,22-23' -> {0..15, 20, 22, 23}; every pid must be in [0, P)."""
    pids: set[int] = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        lo, _, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"pid spec {item!r} is not a number or a range like 0-15") from None
        if first > last or first < 0 or last >= partitions:
            raise ValueError(f"pid range {item!r} is outside 0-{partitions - 1}")
        pids.update(range(first, last + 1))
    return frozenset(pids)


@dataclass(slots=True)
class QueryProgress:
    """How far the instance's query has got, for its heartbeat (`fields`): the follower thread that
    heart-beats lives on while the query is stuck in a batch or in planning one, so the controller tells
    a stuck query from a working or idle one by `progress_ms`, the newest time the query completed a
    batch or was seen waiting between triggers (nothing to read, or the next trigger not due). A heartbeat
    without these fields comes from an instance that does not report them."""

    progress_ms: int
    batch: int = -1  # the newest batch the query completed, -1 before its first

    def observe(self, now_ms: int, batch: int, in_trigger: bool) -> None:
        """Take in the newest batch the sink completed and whether the query is inside a trigger now.

        `progress_ms` never goes back: after a step back of this host's wall clock it counts on a
        millisecond per progress until the clock has caught up, so that whoever times progress from its
        change (the health probe, the heartbeat's `stalled_ms`) sees every progress as one."""
        if batch > self.batch or not in_trigger:
            self.progress_ms = max(now_ms, self.progress_ms + 1)
        self.batch = max(self.batch, batch)

    def fields(self) -> dict[str, int]:
        return {"batch": self.batch, "progress_ms": self.progress_ms}


def instance_dir(cfg: Config, name: str) -> Path:
    return Path(cfg.instance.work_dir) / cfg.pipeline / name


NO_SPACE = ("No space left on device", "Disk quota exceeded")
"""ENOSPC and EDQUOT as a failed query's error words them, whether Spark met them writing its checkpoint
(a Java IOException) or the sink writing its files beside it (a Python OSError)."""

ROOM_BYTES = 16 << 20
"""Free space a full disk must have again before the query stopped by it starts again: a batch writes a
few KB of offset and commit log and its state stores' changes, a snapshot of the state now and then."""

ROOM_POLL_S = 2.0

CLOCK_STEP_BACK_S = 5.0
"""A step back of the host's wall clock longer than this restarts the query (decision 0054): Spark's
trigger waits until a wall-clock time, and would run no batch for as long as the clock went back."""


def failed_on_full_disk(error: BaseException) -> bool:
    """Whether a query failed because a disk was full (`NO_SPACE`): the message of its error says so."""
    return any(words in str(error) for words in NO_SPACE)


def has_room(path: Path) -> bool:
    """Whether the disk of `path` has `ROOM_BYTES` free and inodes left (when it counts them)."""
    disk = os.statvfs(path)
    return disk.f_bavail * disk.f_frsize >= ROOM_BYTES and (disk.f_files == 0 or disk.f_favail > 0)


def wait_for_room(name: str, home: Path, health: InstanceHealth, stop: Callable[[], bool]) -> bool:
    """Wait until the disk of `home` has room again (`has_room`), saying so in the log and on /readyz;
    False if `stop` turns true first. A disk that stays full is judged as any stall is: /healthz fails
    after the stall timeout, the controller moves the pids after its progress timeout (decision 0053)."""
    health.disk_full(str(home))
    log.warning(
        "%s: checkpoint disk full (%s); its query stopped, and starts again from its checkpoint "
        "once the disk has %d MB free",
        name,
        home,
        ROOM_BYTES >> 20,
    )
    while True:
        if stop():
            return False
        time.sleep(ROOM_POLL_S)  # also a pause between restarts, should the query fail again at once
        if has_room(home):
            log.info("%s: the disk has room again; starting the query from its checkpoint", name)
            return True


THREAD_STACK = "64m"
"""JVM thread stack size (reserved address space; only the pages used are committed)."""


JAVA_OPTIONS = f"-Xss{THREAD_STACK} -XX:+ExitOnOutOfMemoryError -XX:TieredStopAtLevel=1"
"""The JVM options of an instance's driver, and of its executors where it has them.

Stopping the query interrupts the batch in foreachBatch; Spark recognises the interruption by matching
the Python traceback with a regex that recurses once per character, which overflows the default 1 MB
thread stack and turns a clean stop into a StackOverflowError. A JVM out of heap exits instead of living
on: an OutOfMemoryError in one of Spark's threads (the task-result getter, collecting a batch with
millions of results) leaves the query waiting forever for a result that never comes, and a hung instance
still heart-beats, so the controller would never recover its pids. Exiting makes it a dead instance
(replay recovery); an executor that exits is replaced by Spark, which reruns its tasks. C1 only
(decision 0011): tiered compilation's C2 kept optimising Spark's planner long after start-up, on a
budget of a fraction of a core, and C2-compiled code was no faster per batch."""


def spark_session(cfg: Config, app_name: str, extra_conf: dict[str, str] | None = None) -> Any:
    """A Spark session tuned for one instance: small shuffles, Arrow, no UI. In local mode on
    `instance.spark_master`, or with `instance.executors` the driver of executor pods
    (`pipeline.executors`); NotInAPod when those cannot be had here."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    executors = cfg.instance.executors
    mode = (
        {"spark.master": cfg.instance.spark_master}
        if executors is None
        else driver_conf(executors, str(Path(cfg.instance.work_dir).resolve()), JAVA_OPTIONS, os.environ)
    )
    builder = SparkSession.builder
    for key, value in {**mode, **(extra_conf or {})}.items():
        builder = builder.config(key, value)
    return (
        builder.appName(app_name)
        .config("spark.driver.memory", cfg.instance.driver_memory)
        .config("spark.driver.extraJavaOptions", JAVA_OPTIONS)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", str(cfg.instance.shuffle_partitions))
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100000")
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "30s")
        .config("spark.sql.streaming.minBatchesToRetain", "20")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.python.worker.reuse", "true")
        # Checkpoint files without Hadoop's checksum files beside them (decision 0041): writing and
        # renaming a checksum file beside each offset and commit log entry slowed every batch.
        .config("spark.hadoop.fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem")
        .config("spark.hadoop.fs.AbstractFileSystem.file.impl", "org.apache.hadoop.fs.local.RawLocalFs")
        # Through Hadoop's FileSystem API, not FileContext (decision 0044): FileContext's create and
        # rename fork a `chmod` and a `readlink` per checkpoint file, 15 processes per batch.
        .config(
            "spark.sql.streaming.checkpointFileManagerClass",
            "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",
        )
        .getOrCreate()
    )


def start_query(
    spark: Any,
    cfg: Config,
    bootstrap: str,
    name: str,
    incarnation: str,
    on_commit: Callable[[BatchRecord], None] | None = None,
    state_budget: Callable[[], int] | None = None,
    spill_gate: Callable[[], bool] | None = None,
) -> tuple[Any, ExactlyOnceSink]:
    """Build and start the instance's streaming query; the assignment file must exist. Returns the query
    and its sink; `on_commit` gets each committed batch's metrics record, from the first batch on,
    `state_budget` says what its windows may hold (the configured budget when None), and `spill_gate`
    whether it spills at its threshold now (`SpillGateMsg`; always when None)."""
    from pipeline.operator import STATE_SCHEMA, make_join_function, output_schema
    from pipeline.sink import ExactlyOnceSink
    from pipeline.source import FluxjoinSource

    home = instance_dir(cfg, name)
    checkpoint = home / "checkpoint"
    watermarks = (home / "watermarks.json").resolve()
    recent_yields = (home / "recent_yields.json").resolve()
    spill_requests = (home / "spill_requests.json").resolve()
    spark.dataSource.register(FluxjoinSource)
    rows = (
        spark.readStream.format("fluxjoin")
        .option("bootstrap", bootstrap)
        .option("streams", ",".join(cfg.streams))
        .option("topics", ",".join(cfg.input_topics))
        .option("assignment", str((home / "assignment.json").resolve()))
        .option("partitions", str(cfg.partitions))
        .option("max_rows", str(cfg.instance.max_rows_per_batch))
        .option("max_results", str(cfg.instance.max_results_per_batch))
        .option("recent_yields", str(recent_yields))
        .option("tasks", str(cfg.instance.shuffle_partitions))
        .option("window_ms", str(cfg.window_ms))
        .option("lateness_ms", str(cfg.allowed_lateness_ms))
        .option("trigger_ms", str(cfg.instance.trigger_ms))
        .option("poll_ms", str(cfg.instance.poll_ms))
        .option("metrics_topic", cfg.metrics_topic)
        .option("instance", name)
        .option("watermarks", str(watermarks))
        .option("control_topic", cfg.control_topic)
        .option("commits_topic", cfg.sink_commits_topic)
        .option("spill_requests", str(spill_requests))
        .option("spill_cleanup", cfg.instance.spill_cleanup)
        .load()
    )
    joined = rows.groupBy("pid").applyInPandasWithState(
        make_join_function(len(cfg.streams), cfg.window_ms, cfg.allowed_lateness_ms),
        outputStructType=output_schema(len(cfg.streams)),
        stateStructType=STATE_SCHEMA,
        outputMode="append",
        timeoutConf="NoTimeout",
    )
    sink = ExactlyOnceSink(
        cfg,
        bootstrap,
        name,
        incarnation,
        checkpoint.resolve(),
        watermarks,
        recent_yields,
        on_commit,
        state_budget,
        spill_requests,
        spill_gate,
    )
    query = (
        joined.writeStream.queryName(name.replace("-", "_"))
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint.resolve()))
        .trigger(processingTime=f"{min(cfg.instance.trigger_ms, cfg.instance.poll_ms)} milliseconds")
        .start()
    )
    return query, sink


def holds_nothing(owned: OwnedPids) -> bool:
    """Whether an instance has nothing left to hand over: no pid owned, being released, or held for
    a parallel track (its own old tuples, or a holder's it takes over)."""
    return not (owned.pids or owned.releasing or owned.old_tracks or owned.track_handoffs)


UNANSWERED_DRAIN_S = 20.0
"""A stopping instance whose assignment has not changed this long after the stop was asked is not being
drained (no operator runs, or it is being deleted with the pipeline): it stops then, and resumes its pids
from its checkpoint if it comes back. An operator that drains answers far sooner (docs/benchmarks.md,
"Measurements behind the code's constants")."""


class Drain:
    """When a stopping instance may stop: at once without a drain timeout, otherwise once its
    assignment holds nothing (`holds_nothing`), the timeout has passed since the stop was asked, or no
    new assignment came for `UNANSWERED_DRAIN_S`."""

    def __init__(
        self,
        name: str,
        timeout_s: float,
        assignment: Path,
        health: InstanceHealth,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.timeout_s, self.assignment, self.health = name, timeout_s, assignment, health
        self.clock = clock
        self.deadline: float | None = None
        self.asked_at = 0.0
        self.epoch_asked = -1

    def may_stop(self, stopping: threading.Event) -> bool:
        if not stopping.is_set():
            return False
        if self.timeout_s <= 0:
            return True
        now = self.clock()
        owned = read_assignment(self.assignment)
        if self.deadline is None:
            self.deadline, self.asked_at, self.epoch_asked = now + self.timeout_s, now, owned.epoch
            self.health.enter(Phase.DRAINING)
            log.info("%s: stopping; waiting up to %g s for its pids to move", self.name, self.timeout_s)
        if holds_nothing(owned):
            log.info("%s: holds no pid any more; stopping", self.name)
            return True
        if owned.epoch == self.epoch_asked and now - self.asked_at >= UNANSWERED_DRAIN_S:
            log.warning(
                "%s: nobody moves its pids (no new assignment in %g s); "
                "stopping (it resumes them from its checkpoint on return)",
                self.name,
                UNANSWERED_DRAIN_S,
            )
            return True
        if now >= self.deadline:
            log.warning(
                "%s: still holds pids after %g s; stopping (it resumes them from its checkpoint on return)",
                self.name,
                self.timeout_s,
            )
            return True
        return False


def _incarnation(home: Path) -> str:
    """The id of this work directory's life; a new one whenever the directory starts empty."""
    path = home / "incarnation"
    if not path.exists():
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def _boot(home: Path) -> int:
    """How many times a process has started on this work directory, this one included: a heartbeat's
    number goes on from the last process's, so a restart's first heartbeat is no replay to the
    controller (`pipeline.signing.fresh`)."""
    path = home / "boots"
    boots = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(boots))
    return boots


def run_instance(
    cfg: Config,
    bootstrap: str,
    name: str,
    pids: frozenset[int] | None,
    *,
    metrics_port: int = 0,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> None:
    """Run until SIGINT/SIGTERM; a restart with the same name resumes from the checkpoint.

    With a `metrics_port` (0: none), /metrics, /healthz and /readyz are served there from the start,
    before the broker is checked, so a probe never meets a closed port while the instance is alive; a
    taken port raises `pipeline.health.MetricsPortError` before anything else happens. /healthz fails
    once the query has made no progress for `stall_timeout_s`.
    """
    home = instance_dir(cfg, name)
    health = InstanceHealth(stall_timeout_s)
    metrics = InstanceMetrics(cfg.pipeline, name, health, home / "assignment.json")
    server = serve(health, metrics, metrics_port) if metrics_port else None
    try:
        _run(cfg, bootstrap, name, pids, health, metrics)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def _run(
    cfg: Config,
    bootstrap: str,
    name: str,
    pids: frozenset[int] | None,
    health: InstanceHealth,
    metrics: InstanceMetrics,
) -> None:
    """`run_instance`'s work, reporting each phase and the query's progress to `health`."""
    from py4j.protocol import Py4JError

    from pipeline.control import FENCED_EXIT_STATUS, ControlLog, InstanceFollower, wait_for
    from pipeline.protocol import eviction_entries
    from pipeline.sink import Fenced, ProducerFailed, TransactionOverrun
    from pipeline.topics import check_reachable, ensure_topics

    check_reachable(bootstrap)
    _certified(name)
    ensure_topics(cfg, bootstrap)
    home = instance_dir(cfg, name)
    assignment = home / "assignment.json"
    control = ControlLog(bootstrap, cfg.control_topic)
    newest = control.catch_up().assignment
    known = (home / "incarnation").read_text().strip() if (home / "incarnation").exists() else None
    if newest is not None and home.exists() and eviction_entries(name, known) & set(newest.evicted):
        log.warning("%s: declared dead while away; its pids live elsewhere now, rejoining empty", name)
        shutil.rmtree(home)
    follower = InstanceFollower(
        cfg, bootstrap, name, _incarnation(home), assignment, control, health.progress_age_s, _boot(home)
    )
    metrics.incarnation = follower.incarnation
    progress = QueryProgress(progress_ms=int(time.time() * 1000))
    follower.progress = progress.fields()
    if newest is None and pids is not None and not assignment.exists():
        write_assignment(assignment, OwnedPids(epoch=0, pids=pids))  # static: no controller has spoken
    follower.start()  # follows the control log and heartbeats from here on
    if not assignment.exists():
        log.info("%s: waiting for an assignment on %s", name, cfg.control_topic)
        wait_for(assignment.exists, timeout_s=3600, what="an assignment from the controller")
    health.enter(Phase.STARTING)
    spark = spark_session(cfg, f"fluxjoin-{name}")
    spark.sparkContext.setLogLevel("WARN")
    if cfg.instance.trigger_ms > cfg.instance.poll_ms:
        # Paced (decision 0027): Spark's trigger is the poll, and it would call every batch longer than
        # a poll "falling behind".
        jvm = spark.sparkContext._jvm
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
            jvm.org.apache.logging.log4j.Level.ERROR,
        )

    def start() -> tuple[Any, ExactlyOnceSink]:
        return start_query(
            spark,
            cfg,
            bootstrap,
            name,
            follower.incarnation,
            metrics.observe_batch,
            lambda: follower.state_budget,
            lambda: follower.spill_at_threshold,
        )

    query, sink = start()
    stopping = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stopping.set()  # only this: the handler runs in the main loop's thread, maybe inside `health`

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    drain = Drain(name, cfg.instance.drain_timeout_s, assignment, health)
    timings = BatchTimingsLog(home / "batch_timings.jsonl") if cfg.instance.batch_timings else None
    health.enter(Phase.RUNNING)
    log.info("%s: running (incarnation %s), checkpoint %s", name, follower.incarnation, home)
    error = None
    try:
        while True:
            wall_less_monotonic = time.time() - time.monotonic()
            stepped_back_s = 0.0
            while not drain.may_stop(stopping) and query.isActive and not follower.evicted.is_set():
                follower.serving = follower.serving or query.lastProgress is not None
                progress.observe(int(time.time() * 1000), sink.completed, query.status["isTriggerActive"])
                follower.progress = progress.fields()
                health.observe(progress.progress_ms, progress.batch, follower.serving)
                if timings is not None:
                    timings.observe(query.recentProgress, sink.phases)
                away = sink.broker_away or follower.broker_away
                health.broker(away)
                time.sleep(0.5) if stopping.is_set() else stopping.wait(0.5)
                now_less_monotonic = time.time() - time.monotonic()
                stepped_back_s = wall_less_monotonic - now_less_monotonic
                if stepped_back_s > CLOCK_STEP_BACK_S:
                    break
                wall_less_monotonic = now_less_monotonic
            error = query.exception()
            # Weather, not death: the query starts again in this process, from its checkpoint (whole:
            # Spark writes each file aside and renames it); the batch runs again, and the sink skips
            # output already in Kafka.
            if stepped_back_s > CLOCK_STEP_BACK_S and error is None:  # decision 0054
                log.warning(
                    "%s: the wall clock stepped back %.0f s; starting the query again", name, stepped_back_s
                )
                query.stop()
                sink.close()
            elif error is not None and failed_on_full_disk(error):  # decision 0053
                sink.close()
                leave = lambda: stopping.is_set() or follower.evicted.is_set()  # noqa: E731
                if not wait_for_room(name, home, health, leave):
                    error = None  # stopped or evicted while waiting: as if the query had stopped so
                    break
                health.disk_full("")
            elif error is not None and any(
                e.__name__ in str(error) for e in (TransactionOverrun, ProducerFailed)
            ):
                # The broker aborted a transaction that an outage kept open past its timeout, and with
                # it this producer's epoch, or the producer failed for good across a broker restart
                # (decision 0052): a new sink initialises a new one.
                sink.close()
                log.warning("%s: %s; starting the query again", name, str(error).splitlines()[0][:300])
            else:
                break
            query, sink = start()
    except (Py4JError, ConnectionError) as lost:  # the JVM exited: out of memory (see spark_session), killed
        health.enter(Phase.STOPPED, f"Spark's JVM is gone ({type(lost).__name__})")
        log.error("%s: Spark's JVM is gone (%s), exiting", name, type(lost).__name__)
        sys.exit(1)
    finally:
        follower.stop()  # no heartbeat outlives the query: the controller must see this instance dead
    if error is not None:
        fenced = Fenced.__name__ in str(error)
        reason = "fenced: another instance owns its pids now" if fenced else f"query failed: {error}"
        health.enter(Phase.STOPPED, reason.splitlines()[0][:300])
        log.error("%s: %s", name, reason)
        spark.stop()
        sys.exit(FENCED_EXIT_STATUS if fenced else 1)
    if follower.evicted.is_set():
        health.enter(Phase.STOPPED, "evicted: declared dead while it ran")
    elif stopping.is_set():
        health.enter(Phase.STOPPING)
    else:
        health.enter(Phase.STOPPED, "query ended")
    query.stop()
    spark.stop()
    if follower.evicted.is_set():
        log.error("%s: evicted while it ran (declared dead); its pids live elsewhere now", name)
        sys.exit(FENCED_EXIT_STATUS)


def _certified(name: str) -> None:
    """On Kubernetes with signing on: a key of this pod's own, certified by the operator as `name`,
    before anything is written (decision 0064). Nothing elsewhere: a local instance is given its key."""
    import tempfile

    from pipeline.signing import ISSUER_ENV, TOKEN_ENV, request_certificate

    issuer = os.environ.get(ISSUER_ENV)
    if not issuer:
        return
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise RuntimeError(
            f"{ISSUER_ENV} is set but {TOKEN_ENV} is not: the pod has no token to prove who it is"
        )
    key = Path(tempfile.gettempdir()) / "fluxjoin-signing" / f"{name}.key"
    signer = request_certificate(issuer, Path(token), key)
    if signer.name != name:
        raise RuntimeError(f"{issuer} certified this pod as {signer.name}, not as {name}")
    log.info("%s: signing as %s, certified by %s", name, signer.name, issuer)
