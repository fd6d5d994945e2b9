"""Run-wide latency percentiles from per-batch metrics samples (local/processes.py), and the demo's
report (local/demo.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from local.demo import LiveStats, write_report
from local.processes import weighted_percentiles
from pipeline.config import load_config


def test_batches_weigh_by_their_result_counts() -> None:
    records = [
        {"results": 900, "latency_sample": [1.0, 1.0, 1.0]},
        {"results": 100, "latency_sample": [5.0]},
        {"results": 0, "latency_sample": []},  # a batch without results carries no sample
    ]
    p50, p99 = weighted_percentiles(records, (50, 99))
    assert p50 == pytest.approx(1.0)
    assert p99 == pytest.approx(5.0)


def test_no_samples_give_none() -> None:
    assert weighted_percentiles([{"results": 0}], (50, 99)) == (None, None)


def _stats() -> LiveStats:
    stats = LiveStats()
    for i in range(4):
        stats.add(
            {
                "kind": "batch",
                "instance": f"instance-{i % 2}",
                "time_ms": 1_000 * i,
                "tuples_in": 100,
                "results": 10,
                "latency_p50_s": 0.5,
            }
        )
    return stats


def test_the_demo_report_has_its_plot_where_matplotlib_is_installed(tmp_path: Path) -> None:
    report = write_report(tmp_path, load_config(None), _stats(), {"exact": True}).read_text()
    assert "![throughput and latency](throughput_latency.png)" in report
    assert (tmp_path / "throughput_latency.png").stat().st_size > 0


def test_the_demo_report_says_why_it_has_no_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image has no plotting library: a report written there says so instead of failing."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    report = write_report(tmp_path, load_config(None), _stats(), {"exact": True}).read_text()
    assert "(no plot: matplotlib is not installed; `pip install 'fluxjoin[plots]'`)" in report
    assert "| exact | True |" in report
    assert not (tmp_path / "throughput_latency.png").exists()
