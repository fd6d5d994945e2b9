"""Run-wide latency percentiles from per-batch metrics samples (local/processes.py)."""

from __future__ import annotations

import pytest

from local.processes import weighted_percentiles


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
