"""A join instance's health and metrics over HTTP: what Kubernetes probes and Prometheus scrapes.

`fluxjoin instance --metrics-port PORT` serves on all interfaces (0: no server, for several instances on
one machine):

- `/metrics`: Prometheus text. The counters and gauges are fed from each committed batch's metrics record,
  the record the sink writes to `<pipeline>.metrics` for the controller, so a scrape shows the numbers the
  policies act on (`InstanceMetrics`); the process's own CPU and memory come with them.
- `/healthz` (liveness): 200 while the instance waits for its assignment, starts its query, runs a query
  that makes progress, or stops on a signal; 503 once its query stopped for good (failed, fenced,
  evicted, the JVM gone) or has made no progress for `stall_timeout_s` (`InstanceHealth`). Progress is
  what the heartbeat's `progress_ms` says (`pipeline.instance.QueryProgress`): a batch completed, or the
  query seen waiting between triggers. A hung query's control follower goes on heartbeating, so the
  controller takes its pids away only after its own progress timeout; a restart is what brings the
  instance itself back, and only the kubelet can do that.
- `/readyz` (readiness): 200 once the query serves (it has run a batch and so taken in its assignment,
  decision 0043), until the instance stops; 503 while its query is stopped by a full disk under its work
  directory and waits for room (decision 0053). A StatefulSet rolling update waits for it pod by pod.
"""

from __future__ import annotations

import bisect
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9108
"""Where an instance serves /metrics, /healthz and /readyz unless told otherwise; the port the chart's
`metrics.port` and the operator's `--metrics-port` default to."""

STALL_TIMEOUT_S = 180.0
"""How long a query may make no progress (or take to start) before /healthz fails. Longer than the
controller's progress timeout (`controller.observation.liveness.PROGRESS_TIMEOUT_S`, 120 s), so that
the controller has moved a stuck instance's pids elsewhere before the kubelet restarts it, and far
longer than any batch: one through a backlog takes tens of seconds."""

BATCH_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Phase(enum.Enum):
    """Where the instance process is in its life, as the probes see it."""

    WAITING = "waiting for an assignment"
    STARTING = "starting its query"
    RUNNING = "running"
    DRAINING = "draining: its pids are moving to other instances before it stops"
    STOPPING = "stopping"
    STOPPED = "stopped"


_QUERYING = (Phase.RUNNING, Phase.DRAINING)
"""The phases in which the query runs and its progress is judged."""


class InstanceHealth:
    """What /healthz and /readyz answer. The instance's main loop reports its phase and its query's
    progress; the HTTP threads read it. Times are on `clock` (monotonic), so a wall-clock step neither
    fakes a stall nor hides one."""

    def __init__(self, stall_timeout_s: float = STALL_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._phase = Phase.WAITING
        self._since = clock()
        self._reason = ""
        self._serving = False
        self._batch = -1
        self._progress_ms: int | None = None
        self._progressed_at = self._since
        self._full_disk = ""
        self._broker_away = ""

    @property
    def phase(self) -> Phase:
        return self._phase

    def enter(self, phase: Phase, reason: str = "") -> None:
        """Move to `phase`; `reason` says why an instance stopped. A stopped instance stays stopped."""
        with self._lock:
            if self._phase is Phase.STOPPED:
                return
            self._phase, self._reason, self._since = phase, reason, self._clock()
            if phase is Phase.RUNNING:
                self._progressed_at = self._since

    def observe(self, progress_ms: int, batch: int, serving: bool) -> None:
        """The query's progress as its heartbeat reports it (`QueryProgress.fields`) and whether it
        serves. Progress is timed here when its wall-clock time moves, not from its value."""
        with self._lock:
            if self._progress_ms is None or progress_ms > self._progress_ms:
                self._progressed_at = self._clock()
            self._progress_ms, self._batch = progress_ms, batch
            self._serving = self._serving or serving

    def disk_full(self, where: str) -> None:
        """The query is stopped because the disk of `where` (its work directory) is full, and waits for
        room (`pipeline.instance`); "" once it runs again. /readyz fails meanwhile, naming the disk;
        /healthz still judges progress only, so a disk full for longer than the stall timeout fails it."""
        with self._lock:
            self._full_disk = where

    @property
    def waiting_for_disk(self) -> bool:
        return bool(self._full_disk)

    def broker(self, away: str) -> None:
        """Why the instance cannot reach Kafka now ("" while it can): its batch in flight or its read of
        the control log met a broker that is away. Neither probe fails for it: the instance waits the
        outage out (decision 0052), and the stall timeout counts from the broker's return."""
        with self._lock:
            self._broker_away = away
            if away:
                self._progressed_at = self._clock()

    @property
    def waiting_for_broker(self) -> bool:
        return bool(self._broker_away)

    def progress_age_s(self) -> float:
        """Seconds since the query last progressed (since the phase began, before the query runs)."""
        with self._lock:
            since = self._progressed_at if self._phase in _QUERYING else self._since
            return max(0.0, self._clock() - since)

    def liveness(self) -> tuple[bool, str]:
        """Whether the process is worth keeping, and a one-line why."""
        age = self.progress_age_s()
        with self._lock:
            phase, reason, batch = self._phase, self._reason, self._batch
        if phase is Phase.STOPPED:
            return False, f"query stopped: {reason}" if reason else "query stopped"
        if phase is Phase.STARTING and age > self.stall_timeout_s:
            return False, f"query not started after {age:.0f} s"
        if phase in _QUERYING and age > self.stall_timeout_s:
            return False, f"query made no progress for {age:.0f} s (newest batch {batch})"
        return True, phase.value

    def readiness(self) -> tuple[bool, str]:
        """Whether the query serves: running, it has run a batch, and no full disk holds it."""
        with self._lock:
            phase, serving, full_disk = self._phase, self._serving, self._full_disk
        if phase is Phase.RUNNING and full_disk:
            return False, f"checkpoint disk full ({full_disk}): waiting for room"
        if phase is Phase.RUNNING and serving:
            return True, "serving"
        if phase is Phase.RUNNING:
            return False, "query has not run a batch yet"
        return False, phase.value


def latency_buckets(sample: Sequence[float], results: int, bounds: Sequence[float]) -> list[int]:
    """Cumulative result counts at each bound, for `results` results whose latencies `sample` represents.

    The sink writes an evenly spaced sample of a batch's sorted latencies (at most 200 values), not every
    latency; each sample value stands for `results / len(sample)` results, as in
    `local.processes.weighted_percentiles`. Counts are whole results, and the last bucket (+Inf) holds
    them all.
    """
    if not sample or results <= 0:
        return [0] * (len(bounds) + 1)
    ordered = sorted(sample)
    counts = [round(bisect.bisect_right(ordered, bound) / len(ordered) * results) for bound in bounds]
    return [*counts, results]


class InstanceMetrics:
    """The instance's Prometheus metrics, one registry per instance (not the library's global one, so
    that several can live in one process, as in the tests).

    `observe_batch` takes each committed batch's metrics record (`pipeline.batch_metrics.batch_record`);
    the rest is read at scrape time: the health, and the pids owned from the assignment file.
    """

    def __init__(
        self, pipeline: str, instance: str, health: InstanceHealth, assignment: Path | None = None
    ) -> None:
        self.pipeline, self.instance, self.health, self.assignment = pipeline, instance, health, assignment
        self.incarnation = ""
        self.registry = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        r = self.registry
        self.tuples = Counter(
            "fluxjoin_instance_tuples", "Input tuples processed by committed batches.", registry=r
        )
        self.results = Counter(
            "fluxjoin_instance_results", "Join results written to the results topic.", registry=r
        )
        self.late = Counter(
            "fluxjoin_instance_late_tuples", "Late tuples written to the dead-letter topic.", registry=r
        )
        self.malformed = Counter(
            "fluxjoin_instance_malformed_records",
            "Malformed input records written to the dead-letter topic.",
            registry=r,
        )
        self.batches = Counter("fluxjoin_instance_batches", "Micro-batches committed.", registry=r)
        self.batch_duration = Histogram(
            "fluxjoin_instance_batch_duration_seconds",
            "Wall time of a committed micro-batch, from its start in the sink to its commit.",
            buckets=BATCH_DURATION_BUCKETS,
            registry=r,
        )
        self.busy = Gauge(
            "fluxjoin_instance_busy_ratio",
            "Share of the time since the previous batch's end spent in the last batch (the policies' load).",
            registry=r,
        )
        self.state_bytes = Gauge(
            "fluxjoin_instance_state_bytes",
            "Window state held: the newest size of each pid's windows, summed over the pids it keeps.",
            registry=r,
        )
        self.state_budget_bytes = Gauge(
            "fluxjoin_instance_state_budget_bytes",
            "Window state the instance may hold (configured, or set while it runs with `fluxjoin budget`).",
            registry=r,
        )
        self.lag = Gauge(
            "fluxjoin_instance_lag_messages",
            "Per pid: input messages (Kafka records) beyond the last committed batch, as of that batch.",
            ["pid"],
            registry=r,
        )
        self.hot_key = Gauge(
            "fluxjoin_instance_hot_key_results",
            "The last batch's results on its hottest key, labelled with the key and its pid: a key far "
            "above the others is what bounds batches by their results.",
            ["pid", "key"],
            registry=r,
        )
        self.last_batch_time = Gauge(
            "fluxjoin_instance_last_batch_timestamp_seconds",
            "Unix time at which the last committed batch measured its metrics.",
            registry=r,
        )
        self._lock = threading.Lock()
        self._lagging: set[str] = set()
        self._latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0
        self.registry.register(_ScrapeTime(self))

    def observe_batch(self, record: Mapping[str, Any]) -> None:
        """Take in one committed batch's metrics record. Runs in the sink after the commit: a record it
        cannot read is reported and skipped, never raised into the query."""
        try:
            self._observe(record)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("%s: metrics of a batch not taken in (%r)", self.instance, exc)

    def _observe(self, record: Mapping[str, Any]) -> None:
        results = int(record["results"])
        sample = [float(v) for v in record.get("latency_sample") or []]
        with self._lock:
            self.tuples.inc(int(record["tuples_in"]))
            self.results.inc(results)
            self.late.inc(int(record.get("late", 0)))
            self.malformed.inc(int(record.get("malformed", 0)))
            self.batches.inc()
            self.batch_duration.observe(float(record["duration_s"]))
            self.busy.set(float(record["busy"]))
            self.last_batch_time.set(int(record["time_ms"]) / 1000)
            hottest = max(
                (
                    (pid, stats["hot_key"])
                    for pid, stats in (record.get("pids") or {}).items()
                    if stats.get("hot_key")
                ),
                key=lambda item: int(item[1][1]),
                default=None,
            )
            if hottest is not None:
                self.hot_key.clear()
                pid, (key, n) = hottest
                self.hot_key.labels(pid=str(pid), key=str(key)).set(int(n))
            self.state_bytes.set(int(record["state_bytes"]))
            self.state_budget_bytes.set(int(record["state_budget_bytes"]))
            lag = {str(pid): int(n) for pid, n in (record.get("lag") or {}).items()}
            for pid, n in lag.items():
                self.lag.labels(pid=pid).set(n)
            for gone in self._lagging - lag.keys():
                self.lag.remove(gone)
            self._lagging = set(lag)
            counts = latency_buckets(sample, results, LATENCY_BUCKETS)
            self._latency_counts = [a + b for a, b in zip(self._latency_counts, counts, strict=True)]
            if sample and results:
                self._latency_sum += sum(sample) / len(sample) * results

    def latency(self) -> tuple[list[int], float]:
        """Cumulative result-latency counts per bucket (+Inf last) and their sum, for a scrape."""
        with self._lock:
            return list(self._latency_counts), self._latency_sum

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The metrics in the format the scraper asked for (`Accept`), and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class _ScrapeTime:
    """The metrics read when scraped: health, the pids owned, identity and result latency."""

    def __init__(self, metrics: InstanceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        info = InfoMetricFamily("fluxjoin_instance", "Which instance of which pipeline this process is.")
        info.add_metric([], {"pipeline": m.pipeline, "instance": m.instance, "incarnation": m.incarnation})
        yield info
        ready, _ = m.health.readiness()
        yield GaugeMetricFamily("fluxjoin_instance_ready", "1 while /readyz answers 200.", value=int(ready))
        yield GaugeMetricFamily(
            "fluxjoin_instance_disk_full",
            "1 while the query is stopped by a full disk under its work directory and waits for room.",
            value=int(m.health.waiting_for_disk),
        )
        yield GaugeMetricFamily(
            "fluxjoin_instance_broker_away",
            "1 while the batch in flight or the control log's read waits for a Kafka broker that is away.",
            value=int(m.health.waiting_for_broker),
        )
        yield GaugeMetricFamily(
            "fluxjoin_instance_progress_age_seconds",
            "Seconds since the query last completed a batch or waited between triggers (/healthz's check).",
            value=m.health.progress_age_s(),
        )
        owned = _owned(m.assignment)
        if owned is not None:
            yield GaugeMetricFamily("fluxjoin_instance_pids", "Pids this instance owns.", value=len(owned[1]))
            yield GaugeMetricFamily(
                "fluxjoin_instance_assignment_epoch", "Epoch of the assignment it acts on.", value=owned[0]
            )
        counts, total = m.latency()
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]
        yield HistogramMetricFamily(
            "fluxjoin_instance_result_latency_seconds",
            "Time from a result's newest input tuple's event time to the commit of its batch.",
            buckets=list(zip(bounds, counts, strict=True)),
            sum_value=total,
        )


def _owned(assignment: Path | None) -> tuple[int, frozenset[int]] | None:
    """(epoch, pids) of the assignment file, None before there is one (or while it cannot be read)."""
    if assignment is None:
        return None
    from pipeline.instance_files import read_assignment

    try:
        owned = read_assignment(assignment)
    except (OSError, ValueError, KeyError):
        return None
    return owned.epoch, owned.pids


class MetricsPortError(RuntimeError):
    """The metrics port cannot be listened on; the message names it and the option that moves it."""


def serve(
    health: InstanceHealth, metrics: InstanceMetrics, port: int, host: str = "0.0.0.0"
) -> ThreadingHTTPServer:
    """Serve /metrics, /healthz and /readyz from a daemon thread; port 0 takes any free port (the
    server's `server_address` says which). Raises MetricsPortError when the port is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, content_type = metrics.render(self.headers.get("Accept", ""))
                self._send(200, body, content_type)
            elif path in ("/healthz", "/readyz"):
                ok, why = health.liveness() if path == "/healthz" else health.readiness()
                self._send(200 if ok else 503, f"{why}\n".encode())
            else:
                self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

        def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Probes come every few seconds: no line per request in the instance's log."""

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise MetricsPortError(
            f"cannot serve metrics on port {port} ({exc.strerror or exc}): pass --metrics-port with a free "
            "port, or 0 for none"
        ) from None
    threading.Thread(target=server.serve_forever, name="fluxjoin-health", daemon=True).start()
    return server
