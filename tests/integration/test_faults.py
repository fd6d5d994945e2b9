"""Faults a running pipeline meets, injected into real instances on a real broker, judged by the oracle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.local import LocalPipeline, wait_drained
from generator.producer import run_generator
from pipeline.oracle import verify_pipeline
from tests.conftest import Broker
from tests.integration.test_pipeline import small_config


def _run_through(
    fault: Callable[[], None], kafka_bootstrap: str, topic_prefix: str, tmp_path: Path, duration_s: int
) -> None:
    """Two instances read what the generator writes in real time (500 tuples/s for `duration_s`);
    10 s in, `fault` runs (and returns once the broker is back). The instances and the generator must
    ride it out, and the output must be exact."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        f"generator.duration_s={duration_s}",
        "generator.rate={kind: constant, rate: 500}",
        "generator.keys={kind: uniform, count: 1000}",
    )
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    try:
        pipeline.start_instance("instance-0", range(0, 4))
        pipeline.start_instance("instance-1", range(4, 8))
        pipeline.wait_running(["instance-0", "instance-1"])
        generator = threading.Thread(target=run_generator, args=(cfg, kafka_bootstrap))
        generator.start()
        time.sleep(10)
        fault()
        generator.join(timeout=240)
        assert not generator.is_alive(), "the generator did not finish after the broker came back"
        wait_drained(pipeline, timeout_s=300)
        pipeline.check_alive()
    finally:
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
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
