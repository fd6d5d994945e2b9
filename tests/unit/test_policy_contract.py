"""What every registered policy must honour, whatever its rule: the contract the controller relies on."""

from __future__ import annotations

import random
from typing import Any

import pytest

from controller.assignment import initial_assignment
from controller.policies import POLICIES, InstanceStats, PidStats, Policy, Snapshot, StaticParams


def random_snapshot(seed: int) -> Snapshot:
    """A cluster with skewed load and state, some pids in flight and one owner that has died."""
    rng = random.Random(seed)
    ids = [f"i{k}" for k in range(rng.randint(2, 6))]
    partitions = len(ids) * rng.randint(2, 10)
    assignment = initial_assignment(partitions, ids)
    dead = ids[-1] if len(ids) > 2 and rng.random() < 0.5 else None
    budgets = rng.random() < 0.7  # else no instance reports a state budget
    return Snapshot(
        now_s=1000.0,
        instances=tuple(
            InstanceStats(j, rng.random(), rng.randint(0, 10_000), rng.randint(1, 12_000) if budgets else 0)
            for j in ids
            if j != dead
        ),
        pids={
            p: PidStats(p, rng.randint(0, 1000), rng.randint(0, 1000), rng.randint(0, 100))
            for p in range(partitions)
        },
        assignment=assignment,
        moves_in_flight=frozenset(rng.sample(range(partitions), rng.randint(0, 2))),
        interval_s=1.0,
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(25))
def test_policy_contract(name: str, seed: int) -> None:
    print(f"seed={seed}")
    policy: Policy[Any] = POLICIES[name]
    assert policy.name == name
    snapshot = random_snapshot(seed)
    params = policy.default_params()
    decision = policy.decide(snapshot, params)
    assert decision == policy.decide(snapshot, params), "same inputs, same decision"
    assert decision.reason, "every decision, a no-change included, says why"
    assert decision.moves or decision.next_interval_s is not None
    live = {s.instance for s in snapshot.instances}
    pids = [m.pid for m in decision.moves]
    assert len(pids) == len(set(pids)), "a pid moves at most once per decision"
    for move in decision.moves:
        assert move.pid not in snapshot.moves_in_flight
        assert snapshot.assignment.owners[move.pid] == move.source
        assert move.source in live and move.target in live
    after = snapshot.assignment.with_moves(decision.moves)
    partitions = len(snapshot.assignment.owners)
    assert after.validate(partitions, snapshot.assignment.instances) == []


def test_static_never_moves() -> None:
    for seed in range(10):
        decision = POLICIES["static"].decide(random_snapshot(seed), StaticParams())
        assert decision.moves == ()
        assert decision.next_interval_s == 1.0


def test_a_snapshot_describes_each_instances_inputs_and_largest_pids() -> None:
    snapshot = Snapshot(
        now_s=0.0,
        instances=(
            InstanceStats("a", 0.5, 0, fixed_busy=0.2, demand=0.75, progress=0.75),
            InstanceStats("b", 0.25, 0),
        ),
        pids={0: PidStats(0, 10, 0, 0), 1: PidStats(1, 300, 0, 0), 2: PidStats(2, 5, 0, 0)},
        assignment=initial_assignment(4, ["a", "b"]),
        interval_s=14.0,
    )
    assert snapshot.describe(largest=1) == (
        "over 14 s: a U 0.750 progress 0.750 busy 0.500 fixed 0.200 T 310 [1:300]; "
        "b U 0.250 busy 0.250 fixed 0.000 T 5 [2:5]"
    )
