"""The cost-growth benchmark's pure parts: its points, their settings and the work figures."""

from __future__ import annotations

import pytest

from bench.growth import MIN_TUPLES, QUOTA_CORES, RATE, SCALE_TUPLES, Point, _points, curves, work_figures
from pipeline.config import Config


def test_each_curve_changes_one_setting_from_the_base() -> None:
    base = Point()
    for name, pairs in curves().items():
        for value, point in pairs:
            changed = {
                f
                for f in ("window_s", "keys", "partitions", "instances")
                if getattr(point, f) != getattr(base, f)
            }
            if name == "window_s":
                assert point.keys == RATE * value, "keys follow W: about one result per tuple"
                assert changed <= {"window_s", "keys"}
            else:
                assert changed <= {name}
                assert getattr(point, name) == value
    assert all(p.quota for _, p in curves()["instances"]), "the instances share the cores by quota"


def test_the_base_lies_on_two_curves_and_runs_once() -> None:
    points = list(_points(curves()))
    assert len(points) == len(set(points))
    assert points.count(Point()) == 1
    assert len(points) == 4 + 5 + 4 + 4 - 1, "window 10 s and pids 64 are both the base"


def test_a_large_window_gets_input_for_three_windows() -> None:
    assert Point(window_s=1).tuples == MIN_TUPLES
    assert Point(window_s=300).tuples == 2 * RATE * 3 * 300


def test_a_point_sets_its_settings_and_quota() -> None:
    cfg = Point(window_s=60, keys=RATE * 60, partitions=256).config(Config(), "p")
    assert (cfg.window_ms, cfg.partitions, cfg.instances) == (60_000, 256, 1)
    assert cfg.instance.cpu_limit is None
    quota = Point(instances=3, quota=True).config(Config(), "q")
    assert quota.instances == 3 and quota.instance.cpu_limit == QUOTA_CORES
    assert quota.instance.spark_master == "local[1]"


def test_work_is_tuples_and_results_per_second() -> None:
    got = work_figures({"tuples": 300, "results": 700, "seconds": 2.0})
    assert got["work_per_s"] == 500.0 and got["us_per_work"] == 2000.0


def test_a_curve_can_be_run_alone_and_an_unknown_one_is_refused() -> None:
    assert list(curves(only=["instances"])) == ["instances"]
    assert all(p.tuples == SCALE_TUPLES for _, p in curves()["instances"]), "a long catch-up per point"
    with pytest.raises(ValueError, match="unknown curves"):
        curves(only=["nope"])
