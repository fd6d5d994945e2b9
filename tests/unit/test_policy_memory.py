"""Memory balancing after Liu & Rundensteiner's distributed adaptation: trigger, cooldown, amount, choice."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from controller.assignment import Assignment, HandoffMode
from controller.policies import POLICIES, InstanceStats, MemoryParams, MemoryPolicy, PidStats, Snapshot

MEMORY = MemoryPolicy()
PARAMS = MemoryParams()

Sites = Mapping[str, Mapping[int, tuple[int, int]]]
"""{instance: {pid: (state_bytes, results)}}; an instance's M_j is the sum of its pids' state."""


def snapshot_of(
    sites: Sites,
    *,
    now_s: float = 1000.0,
    last_adaptation_s: float | None = None,
    limits: Mapping[str, int] | None = None,
    in_flight: frozenset[int] = frozenset(),
) -> Snapshot:
    limits = limits or {}
    return Snapshot(
        now_s=now_s,
        instances=tuple(
            InstanceStats(j, 0.5, sum(size for size, _ in pids.values()), limits.get(j, 0))
            for j, pids in sites.items()
        ),
        pids={
            pid: PidStats(pid, 0, size, results)
            for pids in sites.values()
            for pid, (size, results) in pids.items()
        },
        assignment=Assignment(3, {pid: j for j, pids in sites.items() for pid in pids}),
        moves_in_flight=in_flight,
        interval_s=5.0,
        last_adaptation_s=last_adaptation_s,
    )


def uniform(first_pid: int, count: int, size: int = 100, results: int = 10) -> dict[int, tuple[int, int]]:
    return {first_pid + k: (size, results) for k in range(count)}


@pytest.mark.parametrize(
    ("sites", "moved", "reason"),
    [
        pytest.param(
            {"a": uniform(0, 10), "b": uniform(10, 9)}, [], "0.900 >= theta_d", id="ratio-above-theta"
        ),
        pytest.param(
            {"a": uniform(0, 10), "b": uniform(10, 8)}, [], "0.800 >= theta_d", id="ratio-equal-theta"
        ),
        pytest.param(
            {"a": uniform(0, 10), "b": uniform(10, 7)}, [0], "0.700 < theta_d", id="ratio-below-theta"
        ),
        pytest.param({"a": {0: (0, 0)}, "b": {1: (0, 0)}}, [], "no instance holds state", id="no-state"),
        pytest.param({"a": uniform(0, 10)}, [], "fewer than two", id="single-instance"),
        pytest.param(
            {"a": {0: (1000, 5)}, "b": {}}, [], "no pid fits the budget of 500", id="only-pid-too-big"
        ),
    ],
)
def test_trigger(sites: Sites, moved: list[int], reason: str) -> None:
    decision = MEMORY.decide(snapshot_of(sites), PARAMS)
    assert [m.pid for m in decision.moves] == moved
    assert reason in decision.reason
    assert decision.next_interval_s == 5.0


@pytest.mark.parametrize(
    ("last_adaptation_s", "moves"),
    [
        pytest.param(None, True, id="never-adapted"),
        pytest.param(1000.0 - 10.0, False, id="10s-ago"),
        pytest.param(1000.0 - 44.9, False, id="just-under-the-span"),
        pytest.param(1000.0 - 45.0, True, id="exactly-the-span"),
        pytest.param(0.0, True, id="long-ago"),
    ],
)
def test_min_span_between_adaptations(last_adaptation_s: float | None, moves: bool) -> None:
    sites = {"a": uniform(0, 10), "b": uniform(10, 2)}
    decision = MEMORY.decide(snapshot_of(sites, last_adaptation_s=last_adaptation_s), PARAMS)
    assert decision.changes == moves
    if not moves:
        assert "< min span 45.0 s" in decision.reason


def test_moves_half_the_difference_and_no_more() -> None:
    """M = 1050 and 150: the budget is 450; greedy takes 300, skips 250 and 200 (overshoot), takes 150."""
    sender = {0: (300, 600), 1: (250, 400), 2: (200, 300), 3: (150, 150), 4: (100, 50), 5: (50, 10)}
    decision = MEMORY.decide(snapshot_of({"a": sender, "b": {9: (150, 1)}}), PARAMS)
    assert [(m.pid, m.source, m.target) for m in decision.moves] == [(0, "a", "b"), (3, "a", "b")]
    assert "450 of a 450-byte budget" in decision.reason


@pytest.mark.parametrize("seed_sizes", [(130, 70, 90, 40, 60, 110, 20), (500, 30, 30, 30), (10,) * 30])
def test_amount_is_about_half_without_overshoot(seed_sizes: tuple[int, ...]) -> None:
    sender = {pid: (size, pid + 1) for pid, size in enumerate(seed_sizes)}
    m_max, m_min = sum(seed_sizes), 0
    decision = MEMORY.decide(snapshot_of({"a": sender, "b": {}}), PARAMS)
    moved = sum(sender[m.pid][0] for m in decision.moves)
    budget = (m_max - m_min) // 2
    unmoved = [size for pid, (size, _) in sender.items() if pid not in {m.pid for m in decision.moves}]
    assert moved <= budget
    assert all(moved + size > budget for size in unmoved)  # nothing left that would still fit


@pytest.mark.parametrize(
    ("sender", "moved"),
    [
        pytest.param({0: (100, 1), 1: (100, 50), 2: (100, 10)}, [1], id="most-results-per-byte-first"),
        pytest.param({0: (100, 0), 1: (100, 1), 2: (100, 0)}, [1], id="no-results-last"),
        pytest.param({0: (100, 10), 1: (100, 10), 2: (100, 10)}, [0], id="ties-by-pid"),
        pytest.param({0: (250, 250), 1: (100, 10), 2: (60, 1)}, [1], id="productive-but-too-big-is-skipped"),
        pytest.param({0: (200, 100), 1: (50, 10), 2: (0, 99)}, [1], id="stateless-pid-never-moves"),
    ],
)
def test_most_productive_pids_move_first(sender: dict[int, tuple[int, int]], moved: list[int]) -> None:
    # The receiver holds 100 bytes; the budget is half the gap: 100 bytes in the first three rows, 155 in
    # the fourth (pid 0 overshoots, pid 1 fits, then pid 2 overshoots) and 75 in the last.
    decision = MEMORY.decide(snapshot_of({"a": sender, "b": {9: (100, 1)}}), PARAMS)
    assert [m.pid for m in decision.moves] == moved


def test_receiver_memory_limit_caps_the_budget() -> None:
    sites = {"a": uniform(0, 10), "b": uniform(10, 2)}
    unlimited = MEMORY.decide(snapshot_of(sites), PARAMS)
    capped = MEMORY.decide(snapshot_of(sites, limits={"b": 300}), PARAMS)
    assert len(unlimited.moves) == 4  # (1000 - 200) / 2
    assert len(capped.moves) == 1  # room for 100 more bytes on b


def test_waits_while_a_move_is_in_flight() -> None:
    sites = {"a": uniform(0, 10), "b": uniform(10, 2)}
    decision = MEMORY.decide(snapshot_of(sites, in_flight=frozenset({3})), PARAMS)
    assert decision.moves == ()
    assert "still in flight" in decision.reason


def test_fullest_and_emptiest_ties_are_broken_by_instance_id() -> None:
    sites = {"c": uniform(20, 1), "b": uniform(10, 10), "a": uniform(0, 10), "d": uniform(30, 1)}
    decision = MEMORY.decide(snapshot_of(sites), MemoryParams(mode=HandoffMode.REPLAY))
    assert {(m.source, m.target, m.mode) for m in decision.moves} == {("a", "c", HandoffMode.REPLAY)}


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"theta_d": 0.0}, id="theta-zero"),
        pytest.param({"theta_d": 1.5}, id="theta-above-one"),
        pytest.param({"min_span_s": -1.0}, id="negative-span"),
    ],
)
def test_params_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        MemoryParams(**kwargs)  # type: ignore[arg-type]


def test_paper_defaults_and_registry() -> None:
    assert POLICIES["memory"].default_params() == MemoryParams(theta_d=0.8, min_span_s=45.0)
    assert PARAMS.mode is HandoffMode.TRANSFER


def test_a_spilled_pid_never_moves() -> None:
    """Its old generations are out of memory: a move would bring them back on the sender first."""
    sites = {"a": uniform(0, 10), "b": uniform(10, 2)}
    snap = snapshot_of(sites)
    spilled = {p: replace(s, spilled_bytes=500) if p < 9 else s for p, s in snap.pids.items()}
    decision = MEMORY.decide(replace(snap, pids=spilled), PARAMS)
    assert [m.pid for m in decision.moves] == [9]


@pytest.mark.parametrize(
    ("held", "spill"),
    [
        pytest.param({"a": 900, "b": 300}, False, id="b-has-room"),
        pytest.param({"a": 900, "b": 850}, True, id="none-has-room"),
    ],
)
def test_coupled_spilling_waits_while_an_instance_has_room(held: dict[str, int], spill: bool) -> None:
    """Liu and Rundensteiner's lazy disk spills locally only when no machine has room: with
    `spill_room` 0.8, an instance under 80% of its budget has room, and while one has, instances spill
    only past their whole budget. Every round says so, moves or not."""
    sites = {j: {k: (size, 1)} for k, (j, size) in enumerate(held.items())}
    snap = snapshot_of(sites, limits={"a": 1000, "b": 1000}, in_flight=frozenset({0}))
    decision = MEMORY.decide(snap, replace(PARAMS, spill_room=0.8))
    assert decision.spill is spill
    assert not decision.moves, "a move in flight holds the adaptation back, not the gate"
    assert MEMORY.decide(snap, PARAMS).spill is None, "uncoupled: the policy does not say"


def test_an_instance_without_a_known_budget_has_no_room_to_offer() -> None:
    snap = snapshot_of({"a": {0: (900, 1)}, "b": {1: (10, 1)}}, limits={"a": 1000})
    assert MEMORY.decide(snap, replace(PARAMS, spill_room=0.8)).spill is True
