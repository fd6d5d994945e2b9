"""Flux's memory-constrained round and its hybrid with load balancing: pairing by spare memory, the
biggest pid that narrows a pair's gap, the threshold test, and the hybrid's switch and budget guard."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from controller.assignment import Assignment, Move
from controller.policies import (
    FluxMemoryParams,
    FluxMemoryPolicy,
    FluxParams,
    HybridPolicy,
    InstanceStats,
    PidStats,
    Snapshot,
)

FLUX_MEMORY, HYBRID = FluxMemoryPolicy(), HybridPolicy()


def snapshot_of(
    sites: Mapping[str, Mapping[int, int]],
    budgets: Mapping[str, int],
    busy: Mapping[str, float] | None = None,
    tuples: Mapping[int, int] | None = None,
) -> Snapshot:
    """{instance: {pid: state_bytes}}, each instance's budget, its load and each pid's tuples."""
    busy, tuples = busy or {}, tuples or {}
    return Snapshot(
        now_s=100.0,
        instances=tuple(
            InstanceStats(j, busy.get(j, 0.5), sum(pids.values()), budgets[j]) for j, pids in sites.items()
        ),
        pids={
            p: PidStats(p, tuples.get(p, 100), size, 10)
            for pids in sites.values()
            for p, size in pids.items()
        },
        assignment=Assignment(len(sites), {p: j for j, pids in sites.items() for p in pids}),
        interval_s=2.0,
    )


def test_the_fullest_gives_its_biggest_pid_that_narrows_the_gap_to_the_emptiest() -> None:
    snap = snapshot_of(
        {"a": {0: 700, 1: 200, 2: 50}, "b": {3: 100}, "c": {4: 400}},
        budgets={"a": 1000, "b": 1000, "c": 1000},
    )
    decision = FLUX_MEMORY.decide(snap, FluxMemoryParams())
    # Spare: a 50, c 600, b 900. The pair (a, b) has a gap of 850; moving 700 leaves |850 - 1400| = 550.
    assert decision.moves == (Move(0, "a", "b"),)


def test_in_memory_pids_are_walked_before_spilled_ones() -> None:
    """Moving a spilled pid first brings its old generations back on the donor: an in-memory pid that
    narrows the gap goes first, however much bigger the spilled one is."""
    snap = snapshot_of(
        {"a": {0: 700, 1: 200, 2: 50}, "b": {3: 100}, "c": {4: 400}},
        budgets={"a": 1000, "b": 1000, "c": 1000},
    )
    spilled = dict(snap.pids) | {0: replace(snap.pids[0], spilled_bytes=900)}
    decision = FLUX_MEMORY.decide(replace(snap, pids=spilled), FluxMemoryParams())
    assert decision.moves == (Move(1, "a", "b"),)


def test_a_pid_as_big_as_the_gap_does_not_move() -> None:
    snap = snapshot_of({"a": {0: 800}, "b": {1: 100}}, budgets={"a": 1000, "b": 1000})
    # gap 700: moving 800 leaves |700 - 1600| = 900, wider
    decision = FLUX_MEMORY.decide(snap, FluxMemoryParams())
    assert decision.moves == ()
    assert "no pid" in decision.reason


def test_fill_within_th_imb_is_balanced() -> None:
    snap = snapshot_of({"a": {0: 550}, "b": {1: 500}}, budgets={"a": 1000, "b": 1000})
    decision = FLUX_MEMORY.decide(snap, FluxMemoryParams())
    assert decision.moves == () and decision.balanced


def test_budgets_of_different_sizes_are_compared_by_spare_memory() -> None:
    # b holds more than a but has a budget four times as big: a is the donor.
    snap = snapshot_of({"a": {0: 300, 1: 500}, "b": {2: 1000}}, budgets={"a": 1000, "b": 4000})
    assert FLUX_MEMORY.decide(snap, FluxMemoryParams()).moves == (Move(1, "a", "b"),)


def test_no_round_while_an_instance_reports_no_budget() -> None:
    snap = snapshot_of({"a": {0: 900}, "b": {1: 0}}, budgets={"a": 1000, "b": 0})
    decision = FLUX_MEMORY.decide(snap, FluxMemoryParams())
    assert decision.moves == () and "no state budget reported by b" in decision.reason


def test_hybrid_balances_memory_while_an_instance_is_over_its_budget() -> None:
    # a is over budget and idle; b is busy: load balancing would move from b to a, memory from a to b.
    snap = snapshot_of(
        {"a": {0: 900, 1: 300}, "b": {2: 100, 3: 100}},
        budgets={"a": 1000, "b": 2000},
        busy={"a": 0.1, "b": 0.9},
    )
    decision = HYBRID.decide(snap, FluxParams())
    assert decision.moves == (Move(0, "a", "b"),)
    assert "a spilled or over budget" in decision.reason


def test_hybrid_balances_memory_while_an_instance_has_spilled_state_under_its_budget() -> None:
    # a spilled and is back under its budget; load alone would move from b to a
    sites = {"a": {0: 500, 1: 300}, "b": {2: 100, 3: 100}}
    snap = snapshot_of(sites, budgets={"a": 1000, "b": 2000}, busy={"a": 0.1, "b": 0.9})
    spilled = replace(
        snap,
        instances=tuple(replace(s, spilled_bytes=400 if s.instance == "a" else 0) for s in snap.instances),
    )
    decision = HYBRID.decide(spilled, FluxParams())
    assert decision.moves == (Move(0, "a", "b"),), "the memory round, from the instance that spilled"
    assert "a spilled or over budget" in decision.reason
    load = HYBRID.decide(snap, FluxParams()).moves
    assert load and all(m.source == "b" for m in load), "without the spill, load balancing"


def test_hybrid_balances_load_but_never_into_a_full_budget() -> None:
    sites = {"a": {0: 100, 1: 600}, "b": {2: 100}}
    busy, tuples = {"a": 0.95, "b": 0.1}, {0: 900, 1: 100, 2: 100}
    roomy = snapshot_of(sites, budgets={"a": 1000, "b": 1000}, busy=busy, tuples=tuples)
    assert HYBRID.decide(roomy, FluxParams()).moves == (Move(1, "a", "b"),), "what flux alone moves"
    tight = snapshot_of(sites, budgets={"a": 1000, "b": 500}, busy=busy, tuples=tuples)
    decision = HYBRID.decide(tight, FluxParams())
    assert decision.moves == ()
    assert "refused: no room" in decision.reason
    assert decision.next_interval_s is not None, "no move phase to wait for"
