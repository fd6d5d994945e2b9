"""The memory benchmark's arithmetic: how long an instance stays over its budget, and its peak fill."""

from __future__ import annotations

from typing import Any

from bench.memory import (
    answered_at,
    cleanup_figures,
    fill_at_the_end,
    held_by,
    over_budget_s,
    peak_fill,
    results_over_time,
    results_until,
    variant_settings,
)


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
    assert over_budget_s(records, "i0", from_ms=1000, until_ms=3000) is None, "over when the input ended"


def test_peak_fill_per_instance_after_the_squeeze() -> None:
    records = [
        _batch("i0", 500, 5000, 1000),
        _batch("i0", 1000, 900, 450),
        _batch("i1", 1500, 100, 1000),
        {"kind": "heartbeat", "instance": "i1", "time_ms": 2000},
    ]
    assert peak_fill(records, from_ms=1000) == {"i0": 2.0, "i1": 0.1}
    assert held_by(records, "i0") == 900


def test_the_peak_once_answered_leaves_out_the_batch_that_learned_of_the_budget() -> None:
    records = [
        _batch("i0", 500, 5000, 5000),
        _batch("i1", 900, 100, 1000),
        _batch("i0", 1200, 5000, 2500),  # its first batch under the cut budget: 2.0 by construction
        _batch("i0", 2200, 2000, 2500),
        _batch("i1", 2500, 300, 1000),
    ]
    answered = answered_at(records, "i0", from_ms=1000)
    assert answered == 1200
    assert peak_fill(records, answered + 1) == {"i0": 0.8, "i1": 0.3}
    assert peak_fill(records, answered + 1, until_ms=2300) == {"i0": 0.8}
    assert fill_at_the_end(records) == {"i0": 0.8, "i1": 0.3}
    assert answered_at(records, "i0", from_ms=3000) == float("inf")


def test_results_while_the_input_flowed_and_over_time() -> None:
    records = [
        {**_batch("i0", 1000, 0, 1), "results": 5},
        {**_batch("i1", 4000, 0, 1), "results": 7},
        {**_batch("i0", 12000, 0, 1), "results": 11},
        {"kind": "heartbeat", "instance": "i1", "time_ms": 2000},
    ]
    assert results_until(records, until_ms=4000) == 12
    assert results_over_time(records, start_ms=0) == [12, 0, 11]


def test_the_clean_ups_work_and_how_long_after_the_input_it_ended() -> None:
    records = [
        {**_batch("i0", 1000, 0, 1), "cleaned": {"3": [100, 40]}},  # an active one, mid-run
        {**_batch("i0", 9000, 0, 1), "cleaned": {"4": [30, 2], "5": [0, 0]}},
        {**_batch("i1", 10000, 0, 1), "cleaned": {}},
    ]
    assert cleanup_figures(records, input_end_ms=5000) == {
        "cleanups": 3,
        "cleanup_tuples": 130,
        "cleanup_results": 42,
        "cleanup_s": 4.0,
    }
    assert cleanup_figures(records[:1], input_end_ms=5000)["cleanup_s"] is None


def test_a_spill_variant_runs_no_policy_with_spilling_on() -> None:
    assert variant_settings("hybrid") == ("hybrid", {}, {})
    policy, params, overrides = variant_settings("spill-most-productive", "lazy")
    assert (policy, params) == ("static", {})
    assert overrides["instance.spill_choice"] == "most-productive"
    assert overrides["instance.spill_threshold"] > 0
    assert overrides["instance.spill_cleanup"] == "lazy"


def test_the_coupled_variant_runs_the_memory_policy_with_room_at_the_spill_threshold() -> None:
    policy, params, overrides = variant_settings("memory-spill")
    assert policy == "memory"
    assert params == {"spill_room": overrides["instance.spill_threshold"]}
    assert overrides["instance.spill_choice"] == "least-productive"


def test_hot_pids_give_the_pids_different_productivity_and_keep_their_hot_set() -> None:
    from bench.memory import memory_config
    from pipeline.config import load_config

    uniform = memory_config(load_config(), "m", rate=2000, seconds=90, instances=3, window_s=20)
    hot = memory_config(load_config(), "m", rate=2000, seconds=90, instances=3, window_s=20, hot_pids=True)
    assert uniform.generator.keys.kind == "uniform"
    assert hot.generator.keys.kind == "hot_pids"
    assert hot.generator.keys.move_every_s > 90, "the hot set stays put for the whole input"
