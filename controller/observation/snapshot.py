"""The policies' `Snapshot`: what the observed batch records say of each instance and pid over a round's
collection interval.

Combines the estimators (`controller.observation.estimates`) and the rates
(`controller.observation.rates`) into the one view a policy decides on (decision 0005); apart from
both because this is where an instance's demand is charged to the pids the assignment gives it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from controller.assignment import Assignment
from controller.observation.estimates import (
    cost_per_tuple_s,
    demand_from_progress,
    described_by,
    first_of_new_input,
    fixed_cost_s,
    period_s,
    split_busy,
)
from controller.observation.rates import arrival_rates, in_flight_reading, warming_up
from controller.policies.base import InstanceStats, PidStats, Snapshot


def snapshot_of(
    batches: list[dict[str, Any]],
    live: list[str],
    assignment: Assignment,
    in_flight: frozenset[int],
    now_ms: float,
    interval_s: float,
    now_s: float,
    last_adaptation_s: float | None,
    readings: Sequence[dict[str, Any]] = (),
    streams: int = 1,
    arrivals: Mapping[int, float] | None = None,
    empty_s: Mapping[str, float] | None = None,
) -> Snapshot:
    """Statistics of the instances' batch records that ended in the last `interval_s` seconds (or of
    each one's latest batch, `described_by`); the fixed cost of an instance's batches is fitted on all
    its records at hand (the observer keeps two minutes).

    A pid's tuples (Flux's N_p) are its arrival rate (`arrival_rates`) over the interval. Without a
    rate (a pid's first record), its instances' counts are scaled to `interval_s` by the periods their
    described batches cover: a loaded instance's one batch may cover a minute while an idle one's
    cover the interval, and Flux's estimates compare a donor's pid with the receiver's total. Its
    results (the memory policy's P_o) are its described batches' counts, scaled the same way.

    The rates count what instances' batches in flight have read (`readings` of the pipeline's
    `streams`, `in_flight_reading`): a loaded instance's batch lasts long, and a hot set that arrived
    during its last one would otherwise show only when the next one ends. Where the input's tail gives
    a pid's rate now (`arrivals`, `controller.arrivals.InputTail`), that rate counts instead: an
    instance that is behind has not read what arrives now at all (docs/load-model.md, "Arrival rates").
    `empty_s` gives each instance's shortest batch that read nothing so far, a bound on its fixed cost that
    outlasts the history (`fixed_cost_s`).

    An instance's demand is the share of its time it needs to keep up with the pids the assignment
    gives it: its fixed per-batch share plus, per pid, the pid's arrival rate times the cost per tuple
    of whoever read its tuples (`cost_per_tuple_s`). A pid moved away leaves its old owner's demand
    as soon as the assignment says so, though a parallel track's source still reads its old tuples,
    and joins its new owner's at the cost it had where it was read. A backlog does not count: an
    instance behind its input reads more per batch, not more per second of arrivals (docs/load-model.md,
    "Arrival rates"). Where the instance's own progress says it needs more (`demand_from_progress`), that
    counts instead: the cost per tuple is an average, and a hot key's tuple costs many times a cold one's
    (docs/load-model.md, "Demand and progress").
    """
    since = now_ms - interval_s * 1000
    history, state = _histories(batches, live)
    described = {i: described_by(history[i], since) for i in live}
    read, produced = _read_over_interval(described, interval_s)
    reading = {
        i: in_flight_reading(history[i], [r for r in readings if r["instance"] == i], streams) for i in live
    }
    rates = _rates(live, history, described, reading, read, interval_s, arrivals)
    fixed_s = {i: fixed_cost_s(history[i], (empty_s or {}).get(i)) for i in live}
    busy, cost = _busy_and_cost(live, history, described, fixed_s)
    owned = {p: o for p, o in assignment.owners.items() if o in history}
    demand, progress = _demand(live, history, assignment, owned, read, rates, busy, cost)
    instances = tuple(
        InstanceStats(
            instance=i,
            busy_fraction=busy[i][0],
            fixed_busy=busy[i][1],
            demand=demand[i],
            progress=progress[i],
            state_bytes=sum(v for p, v in state[i].items() if owned.get(p) == i),
            memory_limit_bytes=int(history[i][-1].get("state_budget_bytes", 0)) if history[i] else 0,
            spilled_bytes=sum(history[i][-1].get("spilled", {}).values()) if history[i] else 0,
        )
        for i in sorted(live)
    )
    pid_state = {p: v for i in live for p, v in state[i].items() if owned.get(p) == i}
    spilled = {
        int(p): int(b) for i in live if history[i] for p, b in history[i][-1].get("spilled", {}).items()
    }
    pids = {
        p: PidStats(
            pid=p,
            tuples=round(rates.get(p, 0.0) * interval_s),
            state_bytes=pid_state.get(p, 0),
            results=round(produced.get(p, 0.0)),
            spilled_bytes=spilled.get(p, 0) if owned.get(p) is not None else 0,
        )
        for p in sorted(set(rates) | set(pid_state))
        if p in owned
    }
    return Snapshot(
        now_s=now_s,
        instances=instances,
        pids=pids,
        assignment=assignment,
        moves_in_flight=in_flight,
        interval_s=interval_s,
        last_adaptation_s=last_adaptation_s,
        warming=frozenset(i for i in live if warming_up(history[i], reading[i])),
    )


def _histories(
    batches: list[dict[str, Any]], live: list[str]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[int, int]]]:
    """Each live instance's batch records (oldest first) and the state it holds per pid."""
    history: dict[str, list[dict[str, Any]]] = {i: [] for i in live}
    state: dict[str, dict[int, int]] = {i: {} for i in live}
    for b in batches:
        name = b["instance"]
        if name not in history:
            continue
        for p, s in b["pids"].items():
            state[name][int(p)] = s["state_bytes"]  # newest record wins
        history[name].append(b)
    return history, state


def _read_over_interval(
    described: Mapping[str, Sequence[dict[str, Any]]], interval_s: float
) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """Per pid, the tuples each instance's described batches read and the results they produced, scaled
    to `interval_s` by the periods the batches cover."""
    read: dict[int, dict[str, float]] = {}
    produced: dict[int, float] = {}
    for i, own in described.items():
        period = period_s(own)
        per_interval = interval_s / period if period > 0 else 1.0
        for b in own:
            for p, s in b["pids"].items():
                by = read.setdefault(int(p), {})
                by[i] = by.get(i, 0.0) + s["in"] * per_interval
                produced[int(p)] = produced.get(int(p), 0.0) + s.get("results", 0) * per_interval
    return read, produced


def _rates(
    live: list[str],
    history: Mapping[str, list[dict[str, Any]]],
    described: Mapping[str, list[dict[str, Any]]],
    reading: Mapping[str, dict[str, Any] | None],
    read: Mapping[int, Mapping[str, float]],
    interval_s: float,
    arrivals: Mapping[int, float] | None,
) -> dict[int, float]:
    """Tuples per second per pid: measured (`arrival_rates`, batches in flight included), else its
    count over the interval, and the input's tail where it gives one (`arrivals`)."""
    extra = {i: [r] if r else [] for i, r in reading.items()}
    measured = arrival_rates(
        {i: history[i] + extra[i] for i in live}, {i: described[i] + extra[i] for i in live}
    )
    rates = {p: measured.get(p, sum(by.values()) / interval_s) for p, by in read.items()} | measured
    rates |= arrivals or {}
    return rates


def _busy_and_cost(
    live: list[str],
    history: Mapping[str, list[dict[str, Any]]],
    described: Mapping[str, list[dict[str, Any]]],
    fixed_s: Mapping[str, float],
) -> tuple[dict[str, tuple[float, float]], dict[str, float | None]]:
    """Per instance, (its busy fraction, the fixed part of it) and a tuple's cost (None: unknown)."""
    busy = {}
    cost = {}
    for i in live:
        # The first batch of new input pays for compiling the join (docs/load-model.md, "Warm-up"): it says
        # nothing of a tuple's cost, nor of how busy the instance is, where there are other batches.
        first = {id(b) for b in first_of_new_input(history[i])}
        described_steady = [b for b in described[i] if id(b) not in first]
        busy[i] = split_busy(described_steady or described[i], fixed_s[i])
        # A tuple's cost from the described batches, else the others at hand: a release without
        # reading (decision 0015) says nothing of it.
        steady = [b for b in history[i] if id(b) not in first]
        cost[i] = (
            cost_per_tuple_s(described_steady, fixed_s[i])
            or cost_per_tuple_s(steady, fixed_s[i])
            or cost_per_tuple_s(described[i], fixed_s[i])
            or cost_per_tuple_s(history[i], fixed_s[i])
        )
    return busy, cost


def _demand(
    live: list[str],
    history: Mapping[str, list[dict[str, Any]]],
    assignment: Assignment,
    owned: Mapping[int, str],
    read: Mapping[int, Mapping[str, float]],
    rates: Mapping[int, float],
    busy: Mapping[str, tuple[float, float]],
    cost: Mapping[str, float | None],
) -> tuple[dict[str, float], dict[str, float | None]]:
    """Per instance, its demand (the share of its time the pids it owns need) and what its own progress
    says of it (`demand_from_progress`), which counts where it says more."""
    demand = {i: busy[i][1] for i in live}
    for p, owner in owned.items():
        readers = {i: n for i, n in read.get(p, {}).items() if n > 0 and cost.get(i) is not None}
        if readers:
            per_tuple = sum(n * (cost[i] or 0.0) for i, n in readers.items()) / sum(readers.values())
        else:
            per_tuple = cost[owner] or 0.0
        demand[owner] += rates.get(p, 0.0) * per_tuple
    progress = {i: demand_from_progress(history[i], set(assignment.pids_of(i))) for i in live}
    for i in live:
        demand[i] = max(demand[i], progress[i] or 0.0)
    return demand, progress
