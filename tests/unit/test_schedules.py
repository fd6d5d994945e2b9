"""Rate schedules: rates at given times, and arrivals that are a Poisson process of that rate."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.schedules import (
    ArrivalProcess,
    Schedule,
    arrival_times,
    integrated_rate,
    inverse_integrated_rate,
    rate_at,
    time_of_count,
)
from pipeline.config import ConstantRate, RampRate, StepRate, ToggleRate

STEPS = StepRate(steps=[(0.0, 100.0), (5.0, 0.0), (10.0, 2000.0)])
TOGGLE = ToggleRate(low=100.0, high=1000.0, period_s=1.0)
RAMP_UP = RampRate(start=0.0, end=1000.0, duration_s=10.0)
RAMP_DOWN = RampRate(start=1000.0, end=0.0, duration_s=10.0)
ALL: list[Schedule] = [ConstantRate(rate=500.0), STEPS, TOGGLE, RAMP_UP, RAMP_DOWN]


@pytest.mark.parametrize(
    ("schedule", "t", "rate"),
    [
        pytest.param(ConstantRate(rate=7.0), 123.0, 7.0, id="constant"),
        pytest.param(STEPS, 0.0, 100.0, id="steps-first"),
        pytest.param(STEPS, 4.999, 100.0, id="steps-before-boundary"),
        pytest.param(STEPS, 5.0, 0.0, id="steps-at-boundary"),
        pytest.param(STEPS, 99.0, 2000.0, id="steps-last-holds"),
        pytest.param(TOGGLE, 0.5, 100.0, id="toggle-starts-low"),
        pytest.param(TOGGLE, 1.5, 1000.0, id="toggle-high"),
        pytest.param(TOGGLE, 2.0, 100.0, id="toggle-low-again"),
        pytest.param(RAMP_UP, 0.0, 0.0, id="ramp-start"),
        pytest.param(RAMP_UP, 2.5, 250.0, id="ramp-mid"),
        pytest.param(RAMP_UP, 30.0, 1000.0, id="ramp-holds-end"),
        pytest.param(RAMP_DOWN, 5.0, 500.0, id="ramp-down-mid"),
    ],
)
def test_rate_at(schedule: Schedule, t: float, rate: float) -> None:
    assert rate_at(schedule, t) == pytest.approx(rate)


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind)
def test_integrated_rate_is_the_integral_of_rate_at(schedule: Schedule) -> None:
    ts = np.linspace(0.0, 25.0, 25_001)
    rates = np.array([rate_at(schedule, t) for t in ts[:-1]])
    riemann = np.concatenate(([0.0], np.cumsum(rates * np.diff(ts))))
    # Left Riemann sums are off by at most (max rate jump) * dt per discontinuity.
    np.testing.assert_allclose(integrated_rate(schedule, ts), riemann, atol=50.0)


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind)
def test_inverse_integrated_rate_inverts(schedule: Schedule) -> None:
    total = float(integrated_rate(schedule, 25.0))
    u = np.linspace(1e-3, total, 1000)
    t = inverse_integrated_rate(schedule, u)
    np.testing.assert_allclose(integrated_rate(schedule, t), u, rtol=1e-9, atol=1e-6)
    assert (np.diff(t) >= 0).all()


def test_constant_rate_poisson_mean_and_gaps() -> None:
    rate, seconds = 2000.0, 100.0
    t = arrival_times(ConstantRate(rate=rate), 0.0, seconds, np.random.default_rng(7))
    expected = rate * seconds
    assert abs(len(t) - expected) < 5 * np.sqrt(expected)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    # Exponential gaps: coefficient of variation 1 (a regular or bursty process would not pass).
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.02)
    # Counts per 1 s window: Poisson, so variance == mean.
    counts = np.bincount(np.floor(t).astype(int), minlength=int(seconds))
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.35)


def test_toggle_counts_per_half_period() -> None:
    schedule = ToggleRate(low=200.0, high=2000.0, period_s=0.5)
    t = arrival_times(schedule, 0.0, 40.0, np.random.default_rng(3))
    halves = np.bincount(np.floor(t / 0.5).astype(int), minlength=80)
    low, high = halves[0::2], halves[1::2]
    assert low.mean() == pytest.approx(100.0, rel=0.1)
    assert high.mean() == pytest.approx(1000.0, rel=0.05)
    assert high.min() > low.max()


def test_zero_rate_stretches_get_no_arrivals() -> None:
    t = arrival_times(STEPS, 0.0, 20.0, np.random.default_rng(5))
    assert not ((t >= 5.0) & (t < 10.0)).any()
    assert ((t >= 10.0) & (t < 20.0)).sum() == pytest.approx(20_000, rel=0.05)
    off = ToggleRate(low=0.0, high=1000.0, period_s=1.0)
    t2 = arrival_times(off, 0.0, 10.0, np.random.default_rng(5))
    assert (np.floor(t2).astype(int) % 2 == 1).all()
    assert len(t2) == pytest.approx(5000, rel=0.1)


def test_ramp_counts_follow_the_integral() -> None:
    t = arrival_times(RAMP_UP, 0.0, 10.0, np.random.default_rng(11))
    # First half of the ramp carries a quarter of its mass.
    first, second = (t < 5.0).sum(), (t >= 5.0).sum()
    assert first == pytest.approx(1250, rel=0.12)
    assert second == pytest.approx(3750, rel=0.08)


def test_schedule_that_runs_dry_ends() -> None:
    dry = StepRate(steps=[(0.0, 1000.0), (2.0, 0.0)])
    proc = ArrivalProcess(dry, np.random.default_rng(1))
    taken = proc.take_until(100.0)
    assert len(taken) == pytest.approx(2000, rel=0.1)
    assert taken.max() < 2.0
    assert proc.next_time() == np.inf
    assert len(proc.take_until(1e9)) == 0
    assert len(arrival_times(dry, 3.0, 50.0, np.random.default_rng(1))) == 0


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind)
def test_arrival_times_sorted_and_inside_interval(schedule: Schedule) -> None:
    t = arrival_times(schedule, 3.25, 17.5, np.random.default_rng(2))
    assert len(t) > 0
    assert (np.diff(t) >= 0).all()
    assert t.min() >= 3.25
    assert t.max() < 17.5
    assert len(t) == pytest.approx(
        float(integrated_rate(schedule, 17.5) - integrated_rate(schedule, 3.25)), rel=0.1
    )


@settings(max_examples=40, deadline=None)
@given(
    cuts=st.lists(st.floats(min_value=0.0, max_value=30.0, allow_nan=False), max_size=30),
    which=st.sampled_from(range(len(ALL))),
)
def test_slicing_never_changes_the_arrivals(cuts: list[float], which: int) -> None:
    schedule = ALL[which]
    whole = ArrivalProcess(schedule, np.random.default_rng(99)).take_until(30.0)
    sliced = ArrivalProcess(schedule, np.random.default_rng(99))
    parts = [sliced.take_until(c) for c in sorted(cuts)] + [sliced.take_until(30.0)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    a = arrival_times(TOGGLE, 0.0, 10.0, np.random.default_rng(1))
    b = arrival_times(TOGGLE, 0.0, 10.0, np.random.default_rng(1))
    c = arrival_times(TOGGLE, 0.0, 10.0, np.random.default_rng(2))
    np.testing.assert_array_equal(a, b)
    assert len(a) != len(c) or not np.array_equal(a, c)


@pytest.mark.parametrize("schedule", ALL, ids=lambda s: s.kind)
def test_time_of_count_is_where_the_expected_count_is_reached(schedule: Schedule) -> None:
    two = [schedule, ConstantRate(rate=300.0)]
    for count in (10.0, 1234.5, 20_000.0):
        t = time_of_count(two, count)
        total = sum(float(integrated_rate(s, t)) for s in two)
        assert total == pytest.approx(count, rel=1e-6)
        earlier = sum(float(integrated_rate(s, t * (1 - 1e-4))) for s in two)
        assert earlier < count


def test_time_of_count_of_schedules_that_run_dry() -> None:
    dry = StepRate(steps=[(0.0, 100.0), (5.0, 0.0)])  # 500 expected arrivals, all in [0, 5)
    assert time_of_count([dry], 250.0) == pytest.approx(2.5)
    assert time_of_count([dry], 10_000.0) == pytest.approx(5.0, abs=0.01)
    assert time_of_count([dry], 0.0) == 0.0
