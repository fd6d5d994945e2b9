"""Rate schedules as Poisson processes: the rate at a time, and exact vectorized arrival times.

Pure: no I/O, no clock reads; randomness only from the `numpy.random.Generator` passed in.

Arrivals use the time-change theorem instead of thinning: if E1, E2, ... are unit exponential gaps and
U_i = E1 + ... + Ei, then T_i = Λ⁻¹(U_i) is a Poisson process of rate λ(t), where Λ(t) = ∫₀ᵗ λ is the
integrated rate. Every schedule here is piecewise constant or piecewise linear, so Λ⁻¹ has a closed
form and one batch of exponential gaps maps to one batch of arrival times with a handful of array
operations: exact (no rejection, no discretisation) and with no per-tuple Python work. For a constant
rate it is exactly "exponential inter-arrival gaps of mean 1/rate".

`ArrivalProcess` draws the gaps in blocks of a fixed size, so the arrival times of a stream depend only
on the schedule and the seed, never on how the caller slices time into ticks or chunks: a real-time run
and a max-rate run of the same configuration produce the same tuples.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from pipeline.config import ConstantRate, RampRate, StepRate, ToggleRate

Schedule = ConstantRate | StepRate | ToggleRate | RampRate
F64 = npt.NDArray[np.float64]

# Exponential gaps drawn per refill of an `ArrivalProcess`. Fixed (not derived from the chunk asked for)
# so that the random stream is consumed identically however time is sliced.
GAP_BLOCK = 16_384


def rate_at(schedule: Schedule, t_s: float) -> float:
    """Tuples per second at `t_s` seconds after the stream's start (t < 0 counts as 0)."""
    t = max(t_s, 0.0)
    if isinstance(schedule, ConstantRate):
        return schedule.rate
    if isinstance(schedule, StepRate):
        rate = schedule.steps[0][1]
        for start, r in schedule.steps:
            if start > t:
                break
            rate = r
        return rate
    if isinstance(schedule, ToggleRate):
        return schedule.low if math.floor(t / schedule.period_s) % 2 == 0 else schedule.high
    if t >= schedule.duration_s:
        return schedule.end
    return schedule.start + (schedule.end - schedule.start) * t / schedule.duration_s


def integrated_rate(schedule: Schedule, t_s: npt.ArrayLike) -> F64:
    """Λ(t): expected number of arrivals in [0, t), element-wise (t < 0 counts as 0)."""
    t = np.maximum(np.asarray(t_s, dtype=np.float64), 0.0)
    if isinstance(schedule, ConstantRate):
        return schedule.rate * t
    if isinstance(schedule, StepRate):
        starts, rates, cum = _step_tables(schedule)
        i = np.searchsorted(starts, t, side="right") - 1
        return np.asarray(cum[i] + rates[i] * (t - starts[i]), dtype=np.float64)
    if isinstance(schedule, ToggleRate):
        p, low, high = schedule.period_s, schedule.low, schedule.high
        cycles = np.floor(t / (2 * p))
        tau = t - cycles * 2 * p
        within = np.where(tau < p, low * tau, low * p + high * (tau - p))
        return np.asarray(cycles * (low + high) * p + within, dtype=np.float64)
    a, b, d = schedule.start, schedule.end, schedule.duration_s
    tr = np.minimum(t, d)
    ramp = a * tr + (b - a) * tr * tr / (2 * d)
    return np.asarray(ramp + b * np.maximum(t - d, 0.0), dtype=np.float64)


def inverse_integrated_rate(schedule: Schedule, u: F64) -> F64:
    """Λ⁻¹(u) = inf{t : Λ(t) >= u} for u > 0, element-wise; +inf where Λ never reaches u.

    Λ is flat where the rate is 0, so arrivals never land in a zero-rate stretch; +inf means the
    schedule has run dry for good (e.g. a last step of rate 0).
    """
    u = np.asarray(u, dtype=np.float64)
    if isinstance(schedule, ConstantRate):
        return u / schedule.rate
    if isinstance(schedule, StepRate):
        starts, rates, cum = _step_tables(schedule)
        # Last segment whose cumulative mass at its start is < u; it has a positive rate unless it is
        # the final, unbounded segment (a zero-rate segment would have cum[i + 1] == cum[i] < u).
        i = np.maximum(np.searchsorted(cum, u, side="left") - 1, 0)
        r = rates[i]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = starts[i] + (u - cum[i]) / r
        return np.where(r > 0, t, np.inf)
    if isinstance(schedule, ToggleRate):
        p, low, high = schedule.period_s, schedule.low, schedule.high
        mass = (low + high) * p
        if mass == 0:
            return np.full(u.shape, np.inf)
        cycles = np.floor(u / mass)
        v = u - cycles * mass
        with np.errstate(divide="ignore", invalid="ignore"):
            tau = np.where((v <= low * p) & (low > 0), v / low, p + (v - low * p) / high)
        return np.asarray(cycles * 2 * p + tau, dtype=np.float64)
    a, b, d = schedule.start, schedule.end, schedule.duration_s
    ramp_mass = (a + b) * d / 2
    c = (b - a) / d
    with np.errstate(divide="ignore", invalid="ignore"):
        # Root of (c/2)t² + a t = u in the cancellation-free form 2u / (a + sqrt(a² + 2cu)); it is also
        # right for c == 0 and c < 0, and for a == 0.
        disc = np.maximum(a * a + 2 * c * u, 0.0)
        in_ramp = 2 * u / (a + np.sqrt(disc))
        after = d + (u - ramp_mass) / b if b > 0 else np.full(u.shape, np.inf)
    return np.asarray(np.where(u <= ramp_mass, in_ramp, after), dtype=np.float64)


def time_of_count(schedules: list[Schedule], count: float, horizon_s: float = 1e9) -> float:
    """The time by which `count` arrivals are expected over all `schedules` together: the least t with
    sum Λ_i(t) >= count (bisection; Λ is continuous and nondecreasing). When the schedules run dry before
    (sum Λ_i(horizon_s) < count), the time they have all but run dry (99.9% of their expected total).

    The generator spreads its late tuples over a run bounded by a tuple count with it.
    """

    def total(t: float) -> float:
        return float(sum(float(integrated_rate(s, t)) for s in schedules))

    target = min(float(count), 0.999 * total(horizon_s))
    if target <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while total(hi) < target and hi < horizon_s:
        lo, hi = hi, min(hi * 2, horizon_s)
    for _ in range(100):
        mid = (lo + hi) / 2
        if total(mid) >= target:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
    return hi


def _step_tables(schedule: StepRate) -> tuple[F64, F64, F64]:
    starts = np.array([s for s, _ in schedule.steps], dtype=np.float64)
    rates = np.array([r for _, r in schedule.steps], dtype=np.float64)
    cum = np.concatenate(([0.0], np.cumsum(rates[:-1] * np.diff(starts))))
    return starts, rates, cum


def arrival_times(schedule: Schedule, start_s: float, end_s: float, rng: np.random.Generator) -> F64:
    """Sorted Poisson arrival times (seconds since the stream's start) in [start_s, end_s).

    Stand-alone form for one interval: the process is memoryless, so starting at Λ(start_s) is exact.
    A generator slicing one long run into chunks should use `ArrivalProcess`, which keeps its random
    stream independent of the slicing.
    """
    lo = float(integrated_rate(schedule, start_s))
    hi = float(integrated_rate(schedule, end_s))
    if end_s <= start_s or hi <= lo:
        return np.empty(0, dtype=np.float64)
    pieces: list[F64] = []
    u = lo
    expected = hi - lo
    while u < hi:
        # Enough gaps for the expected count plus ~6 standard deviations, so one draw nearly always does.
        n = int(expected + 6 * math.sqrt(expected) + 16)
        us = u + np.cumsum(rng.standard_exponential(n))
        pieces.append(us[us < hi])
        u = float(us[-1])
    times = inverse_integrated_rate(schedule, np.concatenate(pieces))
    return times[(times >= start_s) & (times < end_s)]


class ArrivalProcess:
    """The arrival times of one stream, handed out in successive time slices.

    Gaps are drawn GAP_BLOCK at a time, so the result of any sequence of `take_until` calls is a prefix
    of one and the same infinite sequence: slicing cannot change which tuples exist.
    """

    def __init__(self, schedule: Schedule, rng: np.random.Generator, block: int = GAP_BLOCK) -> None:
        self._schedule = schedule
        self._rng = rng
        self._block = block
        self._u = 0.0  # integrated-rate coordinate of the last gap drawn
        self._buf: F64 = np.empty(0, dtype=np.float64)
        self._pos = 0

    def _refill(self) -> None:
        us = self._u + np.cumsum(self._rng.standard_exponential(self._block))
        self._u = float(us[-1])
        self._buf = inverse_integrated_rate(self._schedule, us)
        self._pos = 0

    def next_time(self) -> float:
        """Time of the next arrival not yet taken (+inf if the schedule has run dry for good)."""
        if self._pos >= len(self._buf):
            self._refill()
        return float(self._buf[self._pos])

    def take_until(self, end_s: float) -> F64:
        """All arrivals not yet taken whose time is < end_s, in order."""
        pieces: list[F64] = []
        while True:
            if self._pos >= len(self._buf):
                self._refill()
            rest = self._buf[self._pos :]
            if rest[-1] >= end_s:
                k = int(np.searchsorted(rest, end_s, side="left"))
                pieces.append(rest[:k])
                self._pos += k
                break
            pieces.append(rest)
            self._pos = len(self._buf)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
