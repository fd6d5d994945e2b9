"""Scaling plans: scale-out and scale-in moves, the next operator step, and a simulated run of many scales."""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from controller.assignment import Assignment, HandoffMode, Move, initial_assignment
from controller.scaling import (
    Plan,
    StepKind,
    instance_name,
    ordinal_of,
    plan_scale_in,
    plan_scale_out,
    plan_step,
)


def layout(**pids: str) -> Assignment:
    """An assignment from instance -> 'a-b,c' ranges, e.g. layout(x_0="0-2", x_1="3-5") (x_0 means x-0)."""
    owners: dict[int, str] = {}
    for key, spec in pids.items():
        for item in spec.split(","):
            lo, _, hi = item.partition("-")
            for pid in range(int(lo), int(hi or lo) + 1):
                owners[pid] = key.replace("_", "-")
    return Assignment(0, owners)


def counts(assignment: Assignment) -> dict[str, int]:
    return {name: len(pids) for name, pids in assignment.by_instance().items()}


def moved(*triples: tuple[int, str, str]) -> tuple[Move, ...]:
    return tuple(Move(pid, source, target) for pid, source, target in triples)


FOUR = layout(x_0="0-1", x_1="2-3", x_2="4-5", x_3="6-7")
THREE = layout(x_0="0-2", x_1="3-5", x_2="6-7")
ALL = {f"x-{i}" for i in range(8)}


# --- names ---


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("x-0", 0, id="zero"),
        pytest.param("x-12", 12, id="two-digits"),
        pytest.param("x-y-3", None, id="other-pipeline-with-dash"),
        pytest.param("x-", None, id="no-ordinal"),
        pytest.param("x-01", None, id="leading-zero"),
        pytest.param("y-1", None, id="other-pipeline"),
        pytest.param("?", None, id="unknown"),
    ],
)
def test_ordinal_of(name: str, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match="is not an instance of pipeline"):
            ordinal_of("x", name)
    else:
        assert ordinal_of("x", name) == expected
        assert instance_name("x", expected) == name


# --- scale-out ---


@pytest.mark.parametrize(
    ("before", "new", "expected"),
    [
        pytest.param(
            layout(x_0="0-2", x_1="3-5", x_2="6-7"),
            ["x-3"],
            moved((2, "x-0", "x-3"), (5, "x-1", "x-3")),
            id="8-pids-3-to-4-takes-from-the-fullest-first",
        ),
        pytest.param(
            layout(x_0="0-3", x_1="4-6", x_2="7-9"),
            ["x-3"],
            moved((2, "x-0", "x-3"), (3, "x-0", "x-3")),
            id="remainder-stays-with-owners-that-hold-more",
        ),
        pytest.param(
            layout(x_0="0-10"),
            ["x-1", "x-2"],
            moved(*[(pid, "x-0", "x-1" if pid % 2 == 0 else "x-2") for pid in range(4, 11)]),
            id="1-to-3-new-take-turns-and-first-new-gets-the-extra",
        ),
        pytest.param(
            layout(x_0="0-29", x_1="30-31", x_2="32-33"),
            ["x-3"],
            moved(*[(pid, "x-0", "x-3") for pid in range(21, 30)]),
            id="skewed-owners-new-instance-gets-an-even-share-not-the-surplus",
        ),
        pytest.param(layout(x_0="0-3", x_1="4-7"), [], (), id="no-new-instances"),
    ],
)
def test_plan_scale_out(before: Assignment, new: list[str], expected: tuple[Move, ...]) -> None:
    moves = plan_scale_out(before, new)
    assert moves == expected
    after = before.with_moves(moves)
    assert after.validate(len(before.owners), [*before.instances, *new]) == []


@pytest.mark.parametrize(
    ("partitions", "old", "new"),
    [
        pytest.param(64, 3, 1, id="64-3-to-4"),
        pytest.param(64, 4, 3, id="64-4-to-7"),
        pytest.param(7, 1, 6, id="7-1-to-7"),
        pytest.param(100, 10, 1, id="100-10-to-11"),
    ],
)
def test_plan_scale_out_balances_a_balanced_layout_and_moves_only_what_the_new_need(
    partitions: int, old: int, new: int
) -> None:
    before = initial_assignment(partitions, [f"x-{i}" for i in range(old)])
    new_names = [f"x-{old + i}" for i in range(new)]
    moves = plan_scale_out(before, new_names)
    after = counts(before.with_moves(moves))
    assert max(after.values()) - min(after.values()) <= 1
    assert len(moves) == sum(after[name] for name in new_names)
    assert {m.target for m in moves} == set(new_names)
    assert [m.pid for m in moves] == sorted(m.pid for m in moves)


@pytest.mark.parametrize(
    ("before", "new", "message"),
    [
        pytest.param(layout(x_0="0-1", x_1="2-3"), ["x-1"], "already own pids", id="new-owns-pids"),
        pytest.param(layout(x_0="0-3"), ["x-1", "x-1"], "distinct", id="duplicate-new"),
        pytest.param(layout(x_0="0-1", x_1="2"), ["x-2", "x-3"], "cannot give a pid", id="too-few-pids"),
    ],
)
def test_plan_scale_out_rejects(before: Assignment, new: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_scale_out(before, new)


def test_plan_scale_out_in_stages_gives_the_final_share_and_moves_no_pid_twice() -> None:
    """Scaling 3 -> 5 when x-4 is ready before x-3: x-4 gets its share of 5 now, x-3 its share later."""
    first = plan_scale_out(THREE, ["x-4"], total=5)
    assert first == moved((2, "x-0", "x-4"))
    middle = THREE.with_moves(first)
    second = plan_scale_out(middle, ["x-3"], total=5)
    assert second == moved((5, "x-1", "x-3"))
    assert sorted(counts(middle.with_moves(second)).values()) == [1, 1, 2, 2, 2]
    assert not {m.pid for m in first} & {m.pid for m in second}


def test_plan_scale_out_keeps_the_handoff_mode() -> None:
    moves = plan_scale_out(layout(x_0="0-3"), ["x-1"], HandoffMode.REPLAY)
    assert {m.mode for m in moves} == {HandoffMode.REPLAY}


# --- scale-in ---


@pytest.mark.parametrize(
    ("before", "drained", "remaining", "expected"),
    [
        pytest.param(
            layout(x_0="0-1", x_1="2-3", x_2="4-5", x_3="6-7"),
            ["x-2", "x-3"],
            ["x-0", "x-1"],
            moved((4, "x-2", "x-0"), (5, "x-2", "x-1"), (6, "x-3", "x-0"), (7, "x-3", "x-1")),
            id="4-to-2-alternates",
        ),
        pytest.param(
            layout(x_0="0-4", x_1="5", x_2="6-7"),
            ["x-2"],
            ["x-0", "x-1"],
            moved((6, "x-2", "x-1"), (7, "x-2", "x-1")),
            id="fewest-pids-first",
        ),
        pytest.param(
            layout(x_0="0-3", x_1="4-7"),
            ["x-1"],
            ["x-0", "x-2"],
            moved((4, "x-1", "x-2"), (5, "x-1", "x-2"), (6, "x-1", "x-2"), (7, "x-1", "x-2")),
            id="an-empty-remaining-instance-takes-first",
        ),
        pytest.param(layout(x_0="0-3", x_1="4-7"), ["x-5"], ["x-0"], (), id="drained-owns-nothing"),
    ],
)
def test_plan_scale_in(
    before: Assignment, drained: list[str], remaining: list[str], expected: tuple[Move, ...]
) -> None:
    moves = plan_scale_in(before, drained, remaining)
    assert moves == expected
    after = before.with_moves(moves)
    assert not set(after.instances) & set(drained)


@pytest.mark.parametrize(
    ("drained", "remaining", "message"),
    [
        pytest.param(["x-1"], [], "at least one remaining", id="nothing-remains"),
        pytest.param(["x-1"], ["x-0", "x-1"], "both drained and remaining", id="overlap"),
    ],
)
def test_plan_scale_in_rejects(drained: list[str], remaining: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_scale_in(layout(x_0="0-1", x_1="2-3"), drained, remaining)


# --- the next step ---


@pytest.mark.parametrize(
    ("replicas", "assignment", "in_flight", "ready", "kind", "width", "moves"),
    [
        pytest.param(3, None, (), set(), StepKind.START, 3, (), id="no-assignment-starts"),
        pytest.param(3, THREE, (), ALL, StepKind.STEADY, 3, (), id="steady"),
        pytest.param(3, THREE, (), set(), StepKind.STEADY, 3, (), id="steady-even-if-owners-not-ready"),
        pytest.param(
            4, THREE, (), {"x-0", "x-1", "x-2"}, StepKind.AWAIT_READY, 4, (), id="scale-out-waits-for-ready"
        ),
        pytest.param(
            4, THREE, (), {"x-3"}, StepKind.SPREAD, 4, moved((2, "x-0", "x-3"), (5, "x-1", "x-3")),
            id="scale-out-spreads-onto-ready",
        ),
        pytest.param(
            5, THREE, (), {"x-4"}, StepKind.SPREAD, 5, moved((2, "x-0", "x-4")),
            id="scale-out-gives-the-ready-subset-its-final-share",
        ),
        pytest.param(
            2, FOUR, (), ALL, StepKind.DRAIN, 4,
            moved((4, "x-2", "x-0"), (5, "x-2", "x-1"), (6, "x-3", "x-0"), (7, "x-3", "x-1")),
            id="scale-in-drains-and-keeps-the-width",
        ),
        pytest.param(
            2, FOUR, moved((7, "x-3", "x-1")), ALL, StepKind.AWAIT_MOVES, 4, (),
            id="moves-in-flight-wait",
        ),
        pytest.param(
            3, THREE, moved((7, "x-2", "x-5")), ALL, StepKind.AWAIT_MOVES, 6, (),
            id="an-in-flight-target-keeps-its-pod",
        ),
        pytest.param(
            3, THREE, moved((7, "?", "x-2")), ALL, StepKind.AWAIT_MOVES, 3, (),
            id="an-unknown-move-source-widens-nothing",
        ),
        pytest.param(
            2, layout(x_0="0-3", x_1="4-7"), (), ALL, StepKind.STEADY, 2, (), id="drained-shrinks"
        ),
        pytest.param(
            1, layout(x_1="0-7"), (), set(), StepKind.AWAIT_READY, 2, (), id="drain-needs-a-target"
        ),
        pytest.param(
            1, layout(x_1="0-7"), (), {"x-0"}, StepKind.DRAIN, 2,
            moved(*[(pid, "x-1", "x-0") for pid in range(8)]),
            id="drain-onto-a-ready-empty-instance",
        ),
    ],
)  # fmt: skip
def test_plan_step(
    replicas: int,
    assignment: Assignment | None,
    in_flight: tuple[Move, ...],
    ready: set[str],
    kind: StepKind,
    width: int,
    moves: tuple[Move, ...],
) -> None:
    plan = plan_step(
        pipeline="x", partitions=8, replicas=replicas, assignment=assignment, in_flight=in_flight, ready=ready
    )
    assert (plan.kind, plan.width, plan.moves) == (kind, width, moves), plan.reason
    assert plan.reason


@pytest.mark.parametrize(
    ("assignment", "stopping", "ready", "kind", "moves"),
    [
        pytest.param(
            layout(x_0="0-3", x_1="4-7"), {"x-1"}, {"x-0"}, StepKind.DRAIN,
            moved(*[(pid, "x-1", "x-0") for pid in range(4, 8)]),
            id="a-stopping-instance-is-drained-onto-the-others",
        ),
        pytest.param(
            layout(x_0="0-7"), {"x-0"}, {"x-1"}, StepKind.DRAIN,
            moved(*[(pid, "x-0", "x-1") for pid in range(8)]),
            id="onto-a-ready-empty-instance-back-from-its-own-restart",
        ),
        pytest.param(
            layout(x_0="0-7"), {"x-1"}, {"x-0", "x-1"}, StepKind.AWAIT_READY, (),
            id="a-stopping-instance-takes-no-pids",
        ),
        pytest.param(
            layout(x_0="0-3", x_1="4-7"), {"x-0", "x-1"}, set(), StepKind.AWAIT_READY, (),
            id="nowhere-to-drain-waits",
        ),
    ],
)  # fmt: skip
def test_plan_step_drains_stopping_instances(
    assignment: Assignment,
    stopping: set[str],
    ready: set[str],
    kind: StepKind,
    moves: tuple[Move, ...],
) -> None:
    """A planned restart under `drain` (decision 0056): the stopping instance's pids go to the others,
    and it takes none while it stops."""
    plan = plan_step(
        pipeline="x", partitions=8, replicas=2, assignment=assignment, in_flight=(), ready=ready,
        stopping=stopping,
    )  # fmt: skip
    assert (plan.kind, plan.width, plan.moves) == (kind, 2, moves), plan.reason


def test_plan_step_start_publishes_contiguous_ranges_over_the_pods() -> None:
    plan = plan_step(pipeline="x", partitions=8, replicas=3, assignment=None, in_flight=(), ready=set())
    assert plan.initial == initial_assignment(8, ["x-0", "x-1", "x-2"])
    assert plan.reason == "publish epoch 0: 8 pids on 3 instances"


@pytest.mark.parametrize(
    ("replicas", "assignment", "message"),
    [
        pytest.param(9, THREE, "replicas must be in 1..8", id="more-replicas-than-pids"),
        pytest.param(0, THREE, "replicas must be in 1..8", id="zero-replicas"),
        pytest.param(3, layout(x_0="0-3", other_1="4-7"), "not an instance of pipeline", id="foreign-owner"),
    ],
)
def test_plan_step_rejects(replicas: int, assignment: Assignment, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_step(
            pipeline="x", partitions=8, replicas=replicas, assignment=assignment, in_flight=(), ready=()
        )


def test_plan_step_is_deterministic() -> None:
    def plan() -> Plan:
        return plan_step(pipeline="x", partitions=8, replicas=2, assignment=FOUR, in_flight=(), ready=ALL)

    assert plan() == plan()


# --- a simulated cluster: many scales, pods that become ready one by one, moves that take a while ---


def _owned_below(assignment: Assignment, width: int) -> bool:
    return all(ordinal_of("x", owner) < width for owner in assignment.owners.values())


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_simulated_scaling_never_leaves_a_pid_without_a_running_owner(seed: int) -> None:
    """Random scale requests, readiness and move completion; checked after every operator round.

    Invariants: every pid is owned by a pod of the StatefulSet at all times; a move's target exists;
    once things settle, the StatefulSet has exactly `replicas` pods, all of them own pids, and pid counts
    differ by at most one (every scale here starts from a settled, balanced layout).
    """
    rng = random.Random(seed)
    partitions = rng.choice([8, 13, 64])
    replicas = rng.randint(1, min(partitions, 6))
    assignment: Assignment | None = None
    in_flight: list[Move] = []
    width = 0
    ready: set[str] = set()
    for scale in range(12):
        for _ in range(200):
            plan = plan_step(
                pipeline="x",
                partitions=partitions,
                replicas=replicas,
                assignment=assignment,
                in_flight=in_flight,
                ready=ready,
            )
            if plan.kind is StepKind.START:
                assignment = plan.initial
            elif plan.moves:
                in_flight.extend(plan.moves)
            assert assignment is not None
            width = plan.width
            assert _owned_below(assignment, width), f"seed {seed}: a pid is owned beyond the StatefulSet"
            assert all(ordinal_of("x", m.target) < width for m in in_flight), f"seed {seed}"
            ready = {name for name in ready if ordinal_of("x", name) < width}
            pending = [f"x-{i}" for i in range(width) if f"x-{i}" not in ready]
            if pending and rng.random() < 0.5:
                ready.add(rng.choice(pending))
            if in_flight and rng.random() < 0.5:
                done = in_flight[: rng.randint(1, len(in_flight))]
                assignment = assignment.with_moves(done)
                in_flight = in_flight[len(done) :]
            if plan.kind is StepKind.STEADY and not in_flight and len(ready) == width:
                break
        else:
            pytest.fail(f"seed {seed}: scale {scale} to {replicas} did not settle")
        assert assignment is not None
        assert width == replicas, f"seed {seed}"
        per_instance: Mapping[str, int] = counts(assignment)
        assert sorted(per_instance) == sorted(f"x-{i}" for i in range(replicas)), f"seed {seed}"
        assert assignment.validate(partitions, per_instance) == []
        if len(ready) == width:
            assert max(per_instance.values()) - min(per_instance.values()) <= 1, (
                f"seed {seed}: {per_instance}"
            )
        replicas = rng.randint(1, min(partitions, 8))
