"""Faults a running pipeline meets, injected into real instances on a real broker, judged by the oracle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.local import LocalPipeline, wait_drained
from controller.moves import request_moves
from controller.soak import Watch, moved
from generator.producer import run_generator
from pipeline.oracle import verify_pipeline
from pipeline.protocol import Mode
from tests.conftest import Broker
from tests.integration.test_pipeline import small_config

INSTANCES = ["instance-0", "instance-1"]


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
    fault: Callable[[], None], bootstrap: str, topic_prefix: str, tmp_path: Path, duration_s: int
) -> None:
    """A controller (static policy, heartbeat timeout 10 s) and two instances; the generator writes in
    real time (500 tuples/s for `duration_s`). 10 s in, `fault` runs (and returns once the broker is
    back). Every process must ride it out: none exits, the controller declares no instance dead for
    having been unable to hear it, and it moves a pid afterwards as ever. The output must be exact."""
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
    try:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=10)
        for name in INSTANCES:
            pipeline.start_instance(name)
        pipeline.wait_running(INSTANCES)
        start = watch.until(lambda v: bool(v.assignment and v.assignment.epoch == 0), 60, "epoch 0")
        assert start.assignment is not None
        generator = threading.Thread(target=run_generator, args=(cfg, bootstrap))
        generator.start()
        time.sleep(10)
        fault()
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


def test_a_broker_silent_for_20_s_mid_run_stalls_the_instances_and_loses_nothing(
    own_broker: Broker, topic_prefix: str, tmp_path: Path
) -> None:
    """The broker's container is paused (every connection goes silent, nothing is closed) for 20 s."""
    broker = own_broker.container

    def pause() -> None:
        broker.pause()
        try:
            time.sleep(20)
        finally:
            broker.unpause()

    _run_through(pause, own_broker.bootstrap, topic_prefix, tmp_path, duration_s=45)


@pytest.mark.parametrize("outage_s", [20])
def test_a_broker_stopped_and_started_again_mid_run_loses_nothing(
    outage_s: int, own_broker: Broker, topic_prefix: str, tmp_path: Path
) -> None:
    """The broker's container is stopped (the broker shuts down: every connection is closed and refused)
    for `outage_s`, then started again (same log, a new broker epoch)."""
    broker = own_broker.container

    def stop_and_start() -> None:
        broker.stop(timeout=30)
        try:
            time.sleep(outage_s)
        finally:
            broker.start()

    _run_through(stop_and_start, own_broker.bootstrap, topic_prefix, tmp_path, duration_s=50)
