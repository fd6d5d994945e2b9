"""The memory benchmark's arithmetic: how long an instance stays over its budget, and its peak fill."""

from __future__ import annotations

from typing import Any

from bench.memory import held_by, over_budget_s, peak_fill


def _batch(instance: str, time_ms: float, state: int, budget: int) -> dict[str, Any]:
    return {
        "kind": "batch",
        "instance": instance,
        "time_ms": time_ms,
        "state_bytes": state,
        "state_budget_bytes": budget,
    }


def test_over_budget_until_its_last_batch_over_it() -> None:
    records = [
        _batch("i0", 500, 900, 1000),  # before the squeeze
        _batch("i0", 1000, 900, 450),
        _batch("i0", 3000, 600, 450),
        _batch("i0", 6000, 400, 450),
        _batch("i1", 7000, 9999, 10),  # another instance
        _batch("i0", 8000, 300, 450),
    ]
    assert over_budget_s(records, "i0", from_ms=1000) == 2.0
    assert over_budget_s(records, "i0", from_ms=6000) == 0.0, "never over after"
    assert over_budget_s(records[:3], "i0", from_ms=1000) is None, "still over at its last batch"


def test_peak_fill_per_instance_after_the_squeeze() -> None:
    records = [
        _batch("i0", 500, 5000, 1000),
        _batch("i0", 1000, 900, 450),
        _batch("i1", 1500, 100, 1000),
        {"kind": "heartbeat", "instance": "i1", "time_ms": 2000},
    ]
    assert peak_fill(records, from_ms=1000) == {"i0": 2.0, "i1": 0.1}
    assert held_by(records, "i0") == 900
