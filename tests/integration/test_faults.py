"""Faults a running pipeline meets, injected into real instances on a real broker, judged by the oracle."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from bench.soak import Watch, moved
from controller.moves.kafka_mover import request_moves
from generator.producer import run_generator
from local.processes import LocalPipeline, wait_drained
from pipeline.config import Config
from pipeline.oracle import VerifyReport, verify_pipeline
from pipeline.protocol import Mode
from pipeline.topics import read_topic
from tests.conftest import Broker
from tests.integration.test_pipeline import _free_port, _scrape, small_config

INSTANCES = ["instance-0", "instance-1"]
REPORTS = Path(__file__).resolve().parents[2] / "reports" / "faults"


def report_recovery(
    cfg: Config, bootstrap: str, fault: str, over_ms: int, instances: Iterable[str], verified: VerifyReport
) -> dict[str, float]:
    """Seconds from the end of a fault (`over_ms`, Unix ms) to each instance's first committed batch with
    input after it, from the metrics topic; written with the oracle's counts to reports/faults/<fault>.json
    (docs/reliability.md quotes them). Every instance must have committed one."""
    first: dict[str, int] = {}
    for _, _, value in read_topic(bootstrap, cfg.metrics_topic):
        record = json.loads(value)
        if record.get("kind") == "batch" and record["tuples_in"] and record["time_ms"] > over_ms:
            name = record["instance"]
            first[name] = min(first.get(name, record["time_ms"]), record["time_ms"])
    recovered = {name: (first[name] - over_ms) / 1000 for name in instances if name in first}
    assert set(recovered) == set(instances), (
        f"no batch with input after the fault from {set(instances) - set(first)}"
    )
    REPORTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "fault": fault,
        "recovered_s": recovered,
        "expected": verified.expected,
        "produced": verified.produced,
        "exact": verified.exact,
    }
    (REPORTS / f"{fault}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return recovered


def serving(cfg: Config, bootstrap: str, instances: Iterable[str], timeout_s: float) -> None:
    """Block until each instance has committed a batch with input (its query serves, and from then on
    the controller judges its progress), or raise."""
    deadline = time.monotonic() + timeout_s
    waiting = set(instances)
    while waiting:
        for _, _, value in read_topic(bootstrap, cfg.metrics_topic):
            record = json.loads(value)
            if record.get("kind") == "batch" and record["tuples_in"]:
                waiting.discard(record["instance"])
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"no batch with input from {sorted(waiting)} within {timeout_s:.0f} s")
        time.sleep(1)


def drained_and_nobody_evicted(pipeline: LocalPipeline, watch: Watch, generator: threading.Thread) -> None:
    """After a fault: the generator finishes, the input drains, every process still runs, and the control
    log evicted no instance (nobody declared dead for the fault)."""
    generator.join(timeout=240)
    assert not generator.is_alive(), "the generator did not finish after the fault"
    wait_drained(pipeline, timeout_s=300)
    pipeline.check_alive()
    after = watch.log.catch_up().assignment
    assert after is not None
    assert not after.evicted, f"instances declared dead: {after.evicted}"


def _run_through(
    fault: Callable[[dict[str, int]], None],
    fault_name: str,
    bootstrap: str,
    topic_prefix: str,
    tmp_path: Path,
    duration_s: int,
) -> None:
    """A controller (static policy, heartbeat timeout 10 s) and two instances; the generator writes in
    real time (500 tuples/s for `duration_s`). Once each instance has committed a batch with input,
    `fault` runs with each instance's metrics port
    (and returns once the broker is back). Every process must ride it out: none exits, the controller
    declares no instance dead for having been unable to hear it, and it moves a pid afterwards as ever.
    The output must be exact; how long each instance took to commit again is reported as `fault_name`
    (`report_recovery`)."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        f"generator.duration_s={duration_s}",
        "generator.rate={kind: constant, rate: 500}",
        "generator.keys={kind: uniform, count: 1000}",
        f"instances={len(INSTANCES)}",
    )
    pipeline = LocalPipeline(cfg, bootstrap, tmp_path)
    watch = Watch(pipeline)
    ports = {name: _free_port() for name in INSTANCES}
    try:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=10)
        for name in INSTANCES:
            pipeline.start_instance(name, metrics_port=ports[name])
        pipeline.wait_running(INSTANCES)
        start = watch.until(lambda v: bool(v.assignment and v.assignment.epoch == 0), 60, "epoch 0")
        assert start.assignment is not None
        generator = threading.Thread(target=run_generator, args=(cfg, bootstrap))
        generator.start()
        serving(pipeline.cfg, bootstrap, INSTANCES, timeout_s=180)
        fault(ports)
        over_ms = int(time.time() * 1000)
        pid, owner = next(iter(start.assignment.owners.items()))
        target = next(name for name in INSTANCES if name != owner)
        request_moves(cfg, bootstrap, [pid], target, Mode.TRANSFER)
        watch.until(moved([pid], target), 240, f"pid {pid} moved to {target} after the fault")
        drained_and_nobody_evicted(pipeline, watch, generator)
    finally:
        watch.log.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    assert report.expected > 1_000, report.describe()
    assert report.exact, report.describe()
    report_recovery(pipeline.cfg, bootstrap, fault_name, over_ms, INSTANCES, report)


def test_a_broker_silent_for_20_s_mid_run_stalls_the_instances_and_loses_nothing(
    own_broker: Broker, topic_prefix: str, tmp_path: Path
) -> None:
    """The broker's container is paused (every connection goes silent, nothing is closed) for 20 s."""
    broker = own_broker.container

    def pause(_: dict[str, int]) -> None:
        broker.pause()
        try:
            time.sleep(20)
        finally:
            broker.unpause()

    _run_through(pause, "broker-paused-20s", own_broker.bootstrap, topic_prefix, tmp_path, duration_s=45)


@pytest.mark.parametrize("outage_s", [20, 150])
def test_a_broker_stopped_and_started_again_mid_run_loses_nothing(
    outage_s: int, own_broker: Broker, topic_prefix: str, tmp_path: Path
) -> None:
    """The broker's container is stopped (the broker shuts down: every connection is closed and refused)
    for `outage_s`, then started again (same log, a new broker epoch). An outage past the instances'
    offset lookups' own deadline (30 s) shows on their /metrics (`fluxjoin_instance_broker_away`); one
    past the controller's progress timeout (120 s) is no stall of the instances' queries."""
    broker = own_broker.container
    away: list[float] = []

    def stop_and_start(ports: dict[str, int]) -> None:
        broker.stop(timeout=30)
        try:
            until = time.monotonic() + outage_s
            while time.monotonic() < until:
                away.extend(_scrape(port)[("fluxjoin_instance_broker_away", ())] for port in ports.values())
                time.sleep(1)
        finally:
            broker.start()

    _run_through(
        stop_and_start,
        f"broker-stopped-{outage_s}s",
        own_broker.bootstrap,
        topic_prefix,
        tmp_path,
        duration_s=50,
    )
    if outage_s > 60:
        assert 1.0 in away, "no instance said on /metrics that the broker was away"


def test_a_topic_read_begun_while_the_broker_is_stopped_waits_for_it_and_yields_every_message_once(
    own_broker: Broker, topic_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Injected: the broker's container stopped for 45 s after a first read of a topic, and a second
    read of it begun during the outage, as `fluxjoin verify` begins each topic's read in turn (the reader
    every reader of fluxjoin's topics uses, `topics.read_records`, with a timeout of 10 s).
    Asserted: the read says once that the broker is away, waits, and once the broker is back yields
    every message once, intact. Before, the read failed on its first metadata request (`_TRANSPORT`)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import NewTopic

    from pipeline.topics import admin_client, read_records

    topic, count = f"{topic_prefix}.read", 300
    admin = admin_client(own_broker.bootstrap)  # kept: a client collected early cancels its futures
    admin.create_topics([NewTopic(topic, 3)])[topic].result(30)
    producer = Producer({"bootstrap.servers": own_broker.bootstrap})
    for i in range(count):
        producer.produce(topic, value=i.to_bytes(8, "little") * 100, partition=i % 3)
    assert producer.flush(60) == 0
    assert len(list(read_records(own_broker.bootstrap, topic, timeout_s=10))) == count

    read: list[bytes | None] = []
    own_broker.container.stop(timeout=30)
    reader = threading.Thread(
        target=lambda: read.extend(v for _, _, v in read_records(own_broker.bootstrap, topic, timeout_s=10))
    )
    try:
        reader.start()
        time.sleep(45)
        assert reader.is_alive(), "the read ended while the broker was away"
    finally:
        own_broker.container.start()
    reader.join(timeout=120)
    assert not reader.is_alive(), "the read did not end after the broker came back"
    assert sorted(int.from_bytes(v[:8], "little") for v in read if v is not None) == list(range(count))
    assert all(v is not None and v == v[:8] * 100 for v in read)
    assert sum("the broker is away" in line for line in caplog.messages) == 1
