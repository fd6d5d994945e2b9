"""An instance whose disk is full (decision 0053), without Spark: how a failed query's error is told
apart, when the disk has room again, and what /readyz and /metrics say meanwhile."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline import instance
from pipeline.health import InstanceHealth, InstanceMetrics, Phase
from pipeline.instance import ROOM_BYTES, failed_on_full_disk, has_room, wait_for_room


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def test_errors_of_a_full_disk_are_told_from_others() -> None:
    """As the query's error words them: an OSError of the sink's files, an IOException of Spark's
    checkpoint (in a task's failure too), a quota; anything else is no full disk."""
    assert failed_on_full_disk(RuntimeError("Return Message: OSError: [Errno 28] No space left on device"))
    assert failed_on_full_disk(RuntimeError("java.io.IOException: No space left on device"))
    assert failed_on_full_disk(
        RuntimeError(
            "Job aborted due to stage failure: ... java.io.IOException: No space left on device\n\tat x"
        )
    )
    assert failed_on_full_disk(OSError(122, "Disk quota exceeded"))
    assert not failed_on_full_disk(RuntimeError("Fenced: instance-0's transactional id was taken over"))


@dataclass
class Disk:
    f_bavail: int
    f_frsize: int = 4096
    f_files: int = 1000
    f_favail: int = 10


def test_the_disk_has_room_with_enough_bytes_and_an_inode_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk(d: Disk) -> None:
        monkeypatch.setattr(os, "statvfs", lambda path: d)

    disk(Disk(f_bavail=ROOM_BYTES // 4096))
    assert has_room(tmp_path)
    disk(Disk(f_bavail=ROOM_BYTES // 4096 - 1))
    assert not has_room(tmp_path), "a few free pages are no room: the next batch would fill them"
    disk(Disk(f_bavail=ROOM_BYTES, f_favail=0))
    assert not has_room(tmp_path), "no inode left is ENOSPC too"
    disk(Disk(f_bavail=ROOM_BYTES, f_files=0, f_favail=0))
    assert has_room(tmp_path), "a filesystem that counts no inodes has no inode limit"


def test_waiting_for_room_is_unready_naming_the_disk_and_ends_when_the_disk_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    health = InstanceHealth(stall_timeout_s=60, clock=clock)
    metrics = InstanceMetrics("p", "instance-0", health)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1_000, batch=3, serving=True)
    monkeypatch.setattr(instance, "ROOM_POLL_S", 0.0)
    answers = iter([False, False, True])
    seen: list[tuple[tuple[bool, str], float]] = []

    def room(path: Path) -> bool:
        seen.append((health.readiness(), _scrape(metrics)["fluxjoin_instance_disk_full"]))
        return next(answers)

    monkeypatch.setattr(instance, "has_room", room)
    assert wait_for_room("instance-0", tmp_path, health, stop=lambda: False)
    unready = (False, f"checkpoint disk full ({tmp_path}): waiting for room")
    assert seen == [(unready, 1.0)] * 3
    assert health.liveness() == (True, "running"), "alive while it waits, until the stall timeout"
    clock.now += 61
    assert health.liveness() == (False, "query made no progress for 61 s (newest batch 3)")
    health.disk_full("")  # the query started again
    assert health.readiness() == (True, "serving")
    assert _scrape(metrics)["fluxjoin_instance_disk_full"] == 0


def test_a_stop_ends_the_wait_for_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(instance, "has_room", lambda path: False)
    monkeypatch.setattr(instance, "ROOM_POLL_S", 0.0)
    stops = iter([False, False, True])
    assert not wait_for_room("instance-0", tmp_path, InstanceHealth(), stop=lambda: next(stops))


def _scrape(metrics: InstanceMetrics) -> dict[str, float]:
    body, _ = metrics.render()
    return {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_a_broker_away_shows_on_metrics_and_fails_no_probe() -> None:
    health = InstanceHealth(stall_timeout_s=60, clock=Clock())
    metrics = InstanceMetrics("p", "instance-0", health)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1_000, batch=3, serving=True)
    health.broker("Failed to query partition leaders: No leaders found")
    assert _scrape(metrics)["fluxjoin_instance_broker_away"] == 1
    assert health.readiness() == (True, "serving") and health.liveness() == (True, "running")
    health.broker("")
    assert _scrape(metrics)["fluxjoin_instance_broker_away"] == 0


def test_a_broker_away_longer_than_the_stall_timeout_is_no_stall() -> None:
    """The stall timeout counts from the broker's return: an outage longer than it failed /healthz as
    soon as it ended, before the query could run a batch."""
    clock = Clock()
    health = InstanceHealth(stall_timeout_s=60, clock=clock)
    health.enter(Phase.RUNNING)
    health.observe(progress_ms=1_000, batch=3, serving=True)
    for _ in range(90):  # 90 s away, as the instance's main loop reports it
        clock.now += 1
        health.broker("Failed to query partition leaders: No leaders found")
    health.broker("")
    assert health.liveness() == (True, "running")
    clock.now += 61
    assert health.liveness() == (False, "query made no progress for 61 s (newest batch 3)")
