"""An instance whose checkpoint disk fills up mid-run, injected for real: its work directory is a small
tmpfs, filled to the last byte while input flows, then emptied again."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from local.processes import LocalPipeline, committed_offsets, wait_drained
from pipeline.oracle import verify_pipeline
from tests.integration.test_faults import report_recovery
from tests.integration.test_pipeline import _free_port, _get, small_config, wait_until

FULL_FOR_S = 25


@contextlib.contextmanager
def small_disk(path: Path, size: str = "64m") -> Iterator[Path]:
    """`path` as a tmpfs of its own of `size`: a disk that can be filled without touching the machine's."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)  # a process still holds a file there


def fill(directory: Path) -> Path:
    """Write zeros into `directory` until its filesystem answers ENOSPC; returns the filler file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    chunk = bytes(1 << 20)
    try:
        while True:
            try:
                if os.write(fd, chunk) < len(chunk):
                    chunk = chunk[:4096]
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) <= 4096:
                    return filler
                chunk = chunk[:4096]  # the last pages
    finally:
        os.close(fd)


def _probe(port: int) -> tuple[int, str]:
    """/readyz's answer; (0, why) when nothing answers (the instance exited: `check_alive` says how)."""
    try:
        return _get(port, "/readyz")
    except OSError as exc:
        return 0, f"no answer ({exc})"


def test_a_full_checkpoint_disk_is_waited_out_and_loses_nothing(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Injected: instance-0's work directory (its Spark checkpoint, its incarnation, its assignment)
    lives on a 64 MB tmpfs of its own; 8 s after its first committed batch of a 60 s run at 500
    tuples/s, a file of zeros fills that tmpfs until it answers ENOSPC, and stays for 25 s while input
    flows; then it is deleted. The next checkpoint or sink write fails and stops the query.

    Asserted: instance-0 never exits; while the disk is full its /readyz answers 503 naming the full
    disk, and its log says so; once the disk has room again it serves again (its query started from
    the checkpoint the full disk interrupted) and catches up; the output is exactly the oracle's
    (nothing lost, nothing twice)."""
    cfg = small_config(
        topic_prefix,
        "generator.mode=real_time",
        "generator.duration_s=60",
        "generator.rate={kind: constant, rate: 500}",
        "generator.keys={kind: uniform, count: 1000}",
    )
    port = _free_port()
    with small_disk(tmp_path / cfg.pipeline / "instance-0") as disk:
        pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
        readiness: list[tuple[float, int, str]] = []
        try:
            pipeline.start_instance("instance-0", range(0, 4), metrics_port=port)
            pipeline.start_instance("instance-1", range(4, 8))
            pipeline.wait_running(["instance-0", "instance-1"])
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
            time.sleep(8)
            filler = fill(disk)
            full_at = time.monotonic()
            while time.monotonic() - full_at < FULL_FOR_S:
                pipeline.check_alive()
                readiness.append((time.monotonic() - full_at, *_probe(port)))
                time.sleep(1)
            filler.unlink()
            room_ms = int(time.time() * 1000)
            pipeline.procs["generator"].wait(120)
            wait_drained(pipeline, timeout_s=300)
            pipeline.check_alive()
            after = _get(port, "/readyz")
        finally:
            pipeline.stop()
    log = (tmp_path / "instance-0.log").read_text(errors="replace")
    assert any(code == 503 and "checkpoint disk full" in why for _, code, why in readiness), (
        f"/readyz while the disk was full: {readiness}"
    )
    assert "checkpoint disk full" in log and "starting the query from its checkpoint" in log, log[-3000:]
    assert after == (200, "serving\n")
    report = verify_pipeline(pipeline.cfg, kafka_bootstrap)
    assert report.expected > 1_000, report.describe()
    assert report.exact, report.describe()
    report_recovery(pipeline.cfg, kafka_bootstrap, "disk-full-25s", room_ms, ["instance-0"], report)
