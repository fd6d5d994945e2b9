"""Memory as a measured, budgeted resource on a real broker with real Spark instances: each batch's
metrics say what the windows hold next to the budget, `fluxjoin budget` squeezes an instance while it
runs, and the memory-constrained policy moves its state away, with output exact by the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.soak import Watch, soak_config
from local.processes import LocalPipeline, MetricsFollower, wait_drained
from pipeline.config import load_config
from pipeline.oracle import verify_pipeline

CONFIGURED = 64 << 20
SQUEEZED = 1000


def test_a_squeezed_instance_reports_its_new_budget_and_flux_memory_moves_its_state_away(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    cfg = soak_config(load_config(), topic_prefix, seconds=150).with_overrides(
        instances=2, window_ms=10_000, **{"instance.state_budget_bytes": CONFIGURED}
    )
    pipeline = LocalPipeline(cfg, kafka_bootstrap, tmp_path)
    watch = Watch(pipeline)
    metrics = MetricsFollower(pipeline.cfg, kafka_bootstrap)
    decisions = tmp_path / "decisions.jsonl"
    records: list[dict[str, Any]] = []

    def newest(instance: str) -> dict[str, Any] | None:
        records.extend(r for r in metrics.poll() if r.get("kind") == "batch")
        mine = [r for r in records if r["instance"] == instance]
        return mine[-1] if mine else None

    def holding(instance: str) -> bool:
        record = newest(instance)
        return record is not None and record["state_bytes"] > 0

    try:
        # th_imb 3: windows of like size never differ that much in fill, a squeezed one does at once
        pipeline.start_controller(policy="flux-memory", policy_params={"th_imb": 3.0}, decisions=decisions)
        for name in ("instance-0", "instance-1"):
            pipeline.start_instance(name)
        pipeline.wait_running(["instance-0", "instance-1"])
        pipeline.start_generator()
        watch.until(lambda v: holding("instance-0") and holding("instance-1"), 120, "windows holding state")
        before = watch.until(lambda v: v.assignment is not None, 10, "an assignment")
        assert before.assignment is not None
        owned_before = sum(1 for o in before.assignment.owners.values() if o == "instance-0")
        assert owned_before == 4, before.assignment
        first = newest("instance-0")
        assert first is not None and first["state_budget_bytes"] == CONFIGURED
        assert first["state_bytes"] < CONFIGURED, "the configured budget holds the windows"

        config = ["--config", str(pipeline.config_path)]
        squeeze = subprocess.run(
            [sys.executable, "-m", "fluxjoin", "budget", "instance-0", str(SQUEEZED), *config],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert squeeze.returncode == 0, squeeze.stderr
        assert f"instance-0: state budget {SQUEEZED:,} bytes" in squeeze.stdout

        deadline = time.monotonic() + 60
        while (record := newest("instance-0")) is None or record["state_budget_bytes"] != SQUEEZED:
            assert time.monotonic() < deadline, "no batch of instance-0 reported the squeezed budget"
            pipeline.check_alive()
            time.sleep(0.5)

        after = watch.until(
            lambda v: v.assignment is not None and "instance-0" not in v.assignment.owners.values(),
            180,
            "flux-memory moving every pid off the squeezed instance",
        )
        assert after.assignment is not None and set(after.assignment.owners.values()) == {"instance-1"}
        rounds = [json.loads(line) for line in decisions.read_text().splitlines()]
        moved = [m for r in rounds for m in r["moves"]]
        assert moved and all(source == "instance-0" for _, source, _ in moved), rounds[-3:]
        assert newest("instance-1") is not None
        pipeline.end_input()
        wait_drained(pipeline, timeout_s=300)
    finally:
        metrics.close()
        watch.log.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, pipeline.bootstrap)
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()
