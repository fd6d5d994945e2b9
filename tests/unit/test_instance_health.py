"""An instance's /healthz, /readyz and /metrics (`pipeline.health`), without Spark: the main loop's
reports and the sink's batch records are played in by hand."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import Config
from pipeline.control import ControlLog, InstanceFollower
from pipeline.health import (
    LATENCY_BUCKETS,
    InstanceHealth,
    InstanceMetrics,
    MetricsPortError,
    Phase,
    latency_buckets,
    serve,
)
from pipeline.instance_files import OwnedPids, write_assignment


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def _health(stall_s: float = 60.0) -> tuple[InstanceHealth, Clock]:
    clock = Clock()
    return InstanceHealth(stall_timeout_s=stall_s, clock=clock), clock


# --- liveness and readiness ---


def test_waiting_for_an_assignment_is_alive_however_long_and_not_ready() -> None:
    health, clock = _health()
    clock.now += 3600
    assert health.liveness() == (True, "waiting for an assignment")
    assert health.readiness() == (False, "waiting for an assignment")


def test_a_query_that_takes_longer_than_the_stall_timeout_to_start_is_not_alive() -> None:
    health, clock = _health(stall_s=60)
    clock.now += 3600
    health.enter(Phase.STARTING)  # the wait before does not count
    clock.now += 60
    assert health.liveness() == (True, "starting its query")
    clock.now += 1
    assert health.liveness() == (False, "query not started after 61 s")
    assert not health.readiness()[0]


def test_a_running_query_is_ready_once_it_serves_and_alive_while_it_progresses() -> None:
    health, clock = _health(stall_s=60)
    health.enter(Phase.STARTING)
    clock.now += 50
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1_000, batch=-1, serving=False)
    assert health.readiness() == (False, "query has not run a batch yet")
    clock.now += 30
    health.observe(progress_ms=2_000, batch=0, serving=True)
    assert health.readiness() == (True, "serving")
    for _ in range(10):  # idle between triggers: progress keeps moving
        clock.now += 30
        health.observe(progress_ms=2_000 + int(clock.now), batch=0, serving=True)
        assert health.liveness() == (True, "running")


def test_a_query_stuck_in_a_batch_fails_liveness_after_the_stall_timeout_and_recovers_when_it_moves() -> None:
    health, clock = _health(stall_s=60)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=5_000, batch=7, serving=True)
    for _ in range(12):  # the loop goes on reporting the same progress time: stuck in batch 8
        clock.now += 5
        health.observe(progress_ms=5_000, batch=7, serving=True)
    assert health.liveness() == (True, "running")
    clock.now += 1
    assert health.liveness() == (False, "query made no progress for 61 s (newest batch 7)")
    assert health.readiness() == (True, "serving"), "readiness is about serving, not liveness"
    health.observe(progress_ms=70_000, batch=8, serving=True)
    assert health.liveness() == (True, "running")


def test_the_stall_is_timed_on_the_probes_clock_not_from_the_progress_value() -> None:
    """A wall-clock step makes `progress_ms` look old or new; only its change counts."""
    health, clock = _health(stall_s=60)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=10**13, batch=3, serving=True)
    clock.now += 59
    assert health.liveness()[0]
    health.observe(progress_ms=1, batch=3, serving=True)  # a step back is no progress
    clock.now += 2
    assert not health.liveness()[0]


def test_stopping_on_a_signal_stays_alive_and_a_stopped_query_stays_dead() -> None:
    health, _ = _health()
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1, batch=0, serving=True)
    health.enter(Phase.STOPPING)
    assert health.liveness() == (True, "stopping")
    assert health.readiness() == (False, "stopping")
    health.enter(Phase.STOPPED, "fenced: another instance owns its pids now")
    health.enter(Phase.RUNNING)
    assert health.liveness() == (False, "query stopped: fenced: another instance owns its pids now")
    assert health.readiness() == (False, "stopped")


def test_a_draining_instance_is_not_ready_and_its_query_must_still_progress() -> None:
    health, clock = _health(stall_s=60.0)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1, batch=0, serving=True)
    health.enter(Phase.DRAINING)
    assert health.readiness() == (False, Phase.DRAINING.value)
    assert health.liveness() == (True, Phase.DRAINING.value)
    clock.now += 61
    assert not health.liveness()[0]


class _Sent:
    """A producer that keeps what it is given (the heartbeat's producer, without a broker)."""

    def __init__(self) -> None:
        self.values: list[dict[str, Any]] = []

    def produce(self, topic: str, key: str, value: bytes, headers: object = None) -> None:
        self.values.append(json.loads(value))

    def poll(self, timeout: float) -> int:
        return 0


def test_the_heartbeats_stall_is_the_one_the_health_probe_judges(tmp_path: Path) -> None:
    """One stall clock: what the controller reads in `stalled_ms` is what /healthz judges, an outage of
    the broker included (decision 0052)."""
    health, clock = _health(stall_s=60)
    follower = InstanceFollower(
        Config(),
        "127.0.0.1:1",
        "i-0",
        "inc",
        tmp_path / "a.json",
        cast(ControlLog, None),
        health.progress_age_s,
    )
    sent = _Sent()
    follower._producer = cast(Any, sent)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1_000, batch=3, serving=True)
    follower.progress = {"batch": 3, "progress_ms": 1_000}
    clock.now += 42
    follower.heartbeat()
    assert sent.values[-1]["stalled_ms"] == 42_000
    for _ in range(90):
        clock.now += 1
        health.broker("Failed to query partition leaders: No leaders found")
    health.broker("")
    follower.heartbeat()
    assert sent.values[-1]["stalled_ms"] == 0, "counted from the broker's return"
    clock.now += 61
    follower.heartbeat()
    assert sent.values[-1]["stalled_ms"] == 61_000 and not health.liveness()[0]


# --- metrics ---


def _record(batch: int, **fields: Any) -> dict[str, Any]:
    """A batch's metrics record as the sink writes it."""
    record: dict[str, Any] = {
        "kind": "batch",
        "instance": "i-0",
        "batch": batch,
        "epoch": 0,
        "time_ms": 1_700_000_000_000 + batch * 1000,
        "duration_s": 0.2,
        "busy": 0.4,
        "tuples_in": 100,
        "results": 0,
        "late": 0,
        "malformed": 0,
        "latency_p50_s": None,
        "latency_p99_s": None,
        "latency_sample": [],
        "pids": {},
        "state_bytes": 0,
        "state_budget_bytes": 1 << 28,
        "lag": {},
    }
    return record | fields


def _scrape(metrics: InstanceMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name and labels -> value, from the Prometheus text a scrape gets."""
    body, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_batch_records_become_counters_gauges_and_histograms(tmp_path: Path) -> None:
    health, _ = _health()
    assignment = tmp_path / "assignment.json"
    metrics = InstanceMetrics("orders", "orders-0", health, assignment)
    metrics.incarnation = "abc123"
    before = _scrape(metrics)
    assert before[("fluxjoin_instance_tuples_total", ())] == 0
    assert ("fluxjoin_instance_pids", ()) not in before, "no assignment yet: no pid count"

    metrics.observe_batch(
        _record(
            0,
            tuples_in=1000,
            results=400,
            late=3,
            malformed=1,
            duration_s=0.3,
            busy=0.25,
            latency_sample=[0.2, 0.4, 0.6, 3.0],
            pids={"1": {"in": 600, "state_bytes": 5000}, "2": {"in": 400, "state_bytes": 3000}},
            state_bytes=8000,
            lag={"1": 12, "2": 0},
        )
    )
    metrics.observe_batch(
        _record(
            1,
            tuples_in=500,
            results=0,
            duration_s=7.0,
            busy=0.9,
            pids={"2": {"in": 500, "state_bytes": 4000}, "1": {"in": 0, "state_bytes": 0}},
            state_bytes=4000,
            state_budget_bytes=3000,
            lag={"2": 30, "3": 5},
        )
    )
    write_assignment(assignment, OwnedPids(epoch=4, pids=frozenset({2, 3})))
    got = _scrape(metrics)

    assert got[("fluxjoin_instance_tuples_total", ())] == 1500
    assert got[("fluxjoin_instance_results_total", ())] == 400
    assert got[("fluxjoin_instance_late_tuples_total", ())] == 3
    assert got[("fluxjoin_instance_malformed_records_total", ())] == 1
    assert got[("fluxjoin_instance_batches_total", ())] == 2
    assert got[("fluxjoin_instance_busy_ratio", ())] == 0.9
    assert got[("fluxjoin_instance_state_bytes", ())] == 4000, "the newest batch's total"
    assert got[("fluxjoin_instance_state_budget_bytes", ())] == 3000, "a budget set while it runs"
    lag = {
        dict(labels)["pid"]: v
        for (name, labels), v in got.items()
        if name == "fluxjoin_instance_lag_messages"
    }
    assert lag == {"2": 30, "3": 5}, "a pid no longer in the batch's offsets has no lag series"
    assert got[("fluxjoin_instance_last_batch_timestamp_seconds", ())] == 1_700_000_001
    assert got[("fluxjoin_instance_batch_duration_seconds_count", ())] == 2
    assert got[("fluxjoin_instance_batch_duration_seconds_sum", ())] == pytest.approx(7.3)
    assert got[("fluxjoin_instance_batch_duration_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("fluxjoin_instance_batch_duration_seconds_bucket", (("le", "10.0"),))] == 2
    # 400 results, each of the 4 sampled latencies standing for 100 of them.
    assert got[("fluxjoin_instance_result_latency_seconds_count", ())] == 400
    assert got[("fluxjoin_instance_result_latency_seconds_sum", ())] == pytest.approx(420.0)
    assert got[("fluxjoin_instance_result_latency_seconds_bucket", (("le", "0.25"),))] == 100
    assert got[("fluxjoin_instance_result_latency_seconds_bucket", (("le", "1.0"),))] == 300
    assert got[("fluxjoin_instance_result_latency_seconds_bucket", (("le", "+Inf"),))] == 400
    assert (got[("fluxjoin_instance_pids", ())], got[("fluxjoin_instance_assignment_epoch", ())]) == (2, 4)
    info = (("incarnation", "abc123"), ("instance", "orders-0"), ("pipeline", "orders"))
    assert got[("fluxjoin_instance_info", info)] == 1
    assert got[("fluxjoin_instance_ready", ())] == 0
    assert ("process_resident_memory_bytes", ()) in got


def test_a_record_the_metrics_cannot_read_is_skipped_not_raised_into_the_query(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = InstanceMetrics("p", "p-0", _health()[0])
    metrics.observe_batch({"kind": "batch"})
    metrics.observe_batch(_record(0, tuples_in=7))
    assert _scrape(metrics)[("fluxjoin_instance_tuples_total", ())] == 7
    assert "p-0: metrics of a batch not taken in" in caplog.text


@pytest.mark.parametrize(
    ("sample", "results", "bounds", "expected"),
    [
        ([], 0, [1.0], [0, 0]),
        ([0.5], 3, [0.1, 1.0], [0, 3, 3]),
        ([0.1, 0.2, 0.3], 10, [0.15, 0.25, 1.0], [3, 7, 10, 10]),  # whole results, cumulative
        ([2.0, 1.0], 4, [1.0], [2, 4]),  # a bound is inclusive (le), the sample unsorted
    ],
)
def test_latency_buckets_weight_each_sampled_latency_by_the_results_it_stands_for(
    sample: list[float], results: int, bounds: list[float], expected: list[int]
) -> None:
    assert latency_buckets(sample, results, bounds) == expected


def test_latency_bucket_counts_never_decrease() -> None:
    sample = [i / 199 * 400 for i in range(200)]
    counts = latency_buckets(sample, 1_234_567, LATENCY_BUCKETS)
    assert counts == sorted(counts) and counts[-1] == 1_234_567


# --- the HTTP server ---


def _get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.headers["Content-Type"], answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def test_the_server_answers_probes_and_scrapes_as_the_instance_stands() -> None:
    health, _ = _health()
    metrics = InstanceMetrics("p", "p-0", health)
    server = serve(health, metrics, 0, host="127.0.0.1")
    port = server.server_address[1]
    try:
        assert _get(port, "/healthz")[::2] == (200, "waiting for an assignment\n")
        assert _get(port, "/readyz")[::2] == (503, "waiting for an assignment\n")
        health.enter(Phase.RUNNING)
        health.observe(progress_ms=1, batch=0, serving=True)
        metrics.observe_batch(_record(0, tuples_in=42))
        assert _get(port, "/readyz")[::2] == (200, "serving\n")
        assert _get(port, "/healthz?verbose=1")[0] == 200
        code, content_type, body = _get(port, "/metrics")
        assert code == 200 and content_type.startswith("text/plain")
        assert "fluxjoin_instance_tuples_total 42.0" in body
        assert "fluxjoin_instance_ready 1.0" in body
        health.enter(Phase.STOPPED, "query failed: boom")
        assert _get(port, "/healthz")[::2] == (503, "query stopped: query failed: boom\n")
        assert _get(port, "/")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_taken_port_is_a_clear_error_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        health, _ = _health()
        with pytest.raises(MetricsPortError, match=rf"port {port} .*--metrics-port"):
            serve(health, InstanceMetrics("p", "p-0", health), port, host="127.0.0.1")
