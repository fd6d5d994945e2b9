"""The skew benchmark's settings: a trigger that leaves an idle instance idle time, keys in every pid;
and its report, where a point that never drained counts as neither sustained nor verified."""

from __future__ import annotations

import pytest

from bench.skew import (
    against_static,
    flux_skew_params,
    skew_config,
    skew_summary,
    skew_trigger_ms,
    sustained_drain_s,
)
from pipeline.config import HotPidsKeys, load_config


@pytest.mark.parametrize(("idle_s", "trigger_ms"), [(2.0, 4000), (3.6, 8000), (1.0, 2000), (4.6, 10000)])
def test_the_trigger_is_twice_an_idle_batch_in_whole_seconds(idle_s: float, trigger_ms: int) -> None:
    assert skew_trigger_ms(idle_s) == trigger_ms


def test_flux_collects_over_two_triggers_and_a_rate_may_drain_in_two_more_plus_ten_seconds() -> None:
    params = flux_skew_params(8000)
    assert (params["delta_s"], params["delta_min_s"]) == (16.0, 16.0)
    assert params["max_moves_per_pair"] > 1
    assert 1 / 16 < params["min_move_share"] < 1  # a hot pid carries 16 times a cold pid's tuples
    assert sustained_drain_s(8000) == 26.0


@pytest.mark.parametrize(
    ("rate", "key_seconds", "keys"), [(4000, 1.0, 2000), (1000, 1.0, 512), (4000, 10, 20000)]
)
def test_keys_follow_the_rate_with_at_least_eight_per_pid(rate: float, key_seconds: float, keys: int) -> None:
    cfg = skew_config(load_config(None), "p", rate, 90, 4, 0.25, key_seconds, 8000)
    assert cfg.generator.keys.count == keys
    assert cfg.instance.trigger_ms == 8000 and cfg.instance.cpu_limit == 0.25


@pytest.mark.parametrize(("given", "period_s"), [({}, 60.0), ({"hot_set_s": 120.0}, 120.0)])
def test_the_hot_pids_move_at_the_given_period(given: dict[str, float], period_s: float) -> None:
    keys = skew_config(load_config(None), "p", 1000, 90, 4, 0.25, 1, 8000, **given).generator.keys
    assert isinstance(keys, HotPidsKeys) and keys.move_every_s == period_s


def test_the_skew_follows_an_even_warm_up_and_the_input_lasts_both() -> None:
    cfg = skew_config(load_config(None), "p", 1000, 90, 4, 0.25, 1, 8000, 120.0, 60.0)
    keys = cfg.generator.keys
    assert isinstance(keys, HotPidsKeys) and keys.even_s == 60.0 and keys.move_every_s == 120.0
    assert cfg.generator.duration_s == 150.0


def test_an_unfinished_point_is_neither_sustained_nor_counted_as_verified() -> None:
    verified = {"sustained": True, "latency_p50_s": 9.6, "latency_p99_s": 17.8, "exact": True}
    unfinished = {"sustained": False, "latency_p50_s": None, "latency_p99_s": None, "exact": None}
    line = skew_summary({3000.0: verified, 6000.0: unfinished}, {"trigger_ms": 11000})
    assert line["sustainable_rate"] == 3000.0 and line["latency_p99_s"] == 17.8
    assert line["exact"] is True and line["points"]["6000"]["exact"] is None
    assert line["trigger_ms"] == 11000
    wrong = skew_summary({3000.0: verified | {"exact": False}, 6000.0: unfinished}, {})
    assert wrong["exact"] is False


def test_flux_is_compared_with_static_at_statics_first_failed_rate() -> None:
    def point(sustained: bool, p50: float | None, p99: float | None) -> dict[str, object]:
        return {"sustained": sustained, "latency_p50_s": p50, "latency_p99_s": p99, "exact": True}

    static = skew_summary({3000.0: point(True, 30.0, 100.0), 4000.0: point(False, 60.0, 280.0)}, {})
    flux = skew_summary({r: point(r < 7000, 9.0, 20.0) for r in (3000.0, 4000.0, 5000.0, 6000.0, 7000.0)}, {})
    compared = against_static(static, flux)
    assert compared == {
        "rate_ratio": 2.0,
        "rate_ratio_at_least": 1.5,
        "static_saturation_rate": 4000.0,
        "latency_p50_ratio": round(60 / 9, 2),
        "latency_p99_ratio": 14.0,
    }
    unfinished = skew_summary({3000.0: point(True, 30.0, 100.0), 4000.0: point(False, None, None)}, {})
    assert against_static(unfinished, flux)["latency_p99_ratio"] is None
    failed_first = against_static(skew_summary({3000.0: point(False, 90.0, 190.0)}, {}), flux)
    assert failed_first["rate_ratio"] is None and failed_first["rate_ratio_at_least"] == 2.0
    assert failed_first["static_saturation_rate"] == 3000.0 and failed_first["latency_p99_ratio"] == 9.5
    never_failed = against_static(static | {"points": {"3000": point(True, 30.0, 100.0)}}, flux)
    assert never_failed["static_saturation_rate"] is None and never_failed["latency_p99_ratio"] is None
