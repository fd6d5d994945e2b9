"""The assignment of record: initial layout, validation, and applying moves at the next epoch."""

from __future__ import annotations

import pytest

from controller.assignment import (
    Assignment,
    AssignmentError,
    HandoffMode,
    Move,
    Violation,
    find_violations,
    initial_assignment,
    validate_claims,
)


def test_initial_assignment_gives_contiguous_ranges_in_the_given_order() -> None:
    assignment = initial_assignment(10, ["i-2", "i-10", "i-1"])
    assert assignment.epoch == 0
    assert assignment.pids_of("i-2") == (0, 1, 2, 3)
    assert assignment.pids_of("i-10") == (4, 5, 6)
    assert assignment.pids_of("i-1") == (7, 8, 9)
    assert assignment.instances == ("i-1", "i-10", "i-2")
    assert assignment.validate(10, ["i-1", "i-2", "i-10"]) == []


@pytest.mark.parametrize(
    ("partitions", "instances"),
    [
        pytest.param(4, [], id="no-instances"),
        pytest.param(4, ["a", "a"], id="duplicate-instance"),
        pytest.param(2, ["a", "b", "c"], id="fewer-pids-than-instances"),
    ],
)
def test_initial_assignment_rejects(partitions: int, instances: list[str]) -> None:
    with pytest.raises(ValueError):
        initial_assignment(partitions, instances)


@pytest.mark.parametrize(
    ("owners", "live", "expected"),
    [
        pytest.param({0: "a", 1: "a", 2: "b"}, ["a", "b"], [], id="valid"),
        pytest.param({0: "a", 2: "b"}, ["a", "b"], [AssignmentError.MISSING_PID], id="missing-pid"),
        pytest.param({0: "a", 1: "a", 2: "b"}, ["a"], [AssignmentError.DEAD_OWNER], id="dead-owner"),
        pytest.param(
            {0: "a", 1: "a", 2: "b", 3: "b"}, ["a", "b"], [AssignmentError.UNKNOWN_PID], id="pid-out-of-range"
        ),
        pytest.param(
            {0: "a", 2: "gone"},
            ["a"],
            [AssignmentError.MISSING_PID, AssignmentError.DEAD_OWNER],
            id="several-kinds-in-enum-order",
        ),
    ],
)
def test_validate(owners: dict[int, str], live: list[str], expected: list[AssignmentError]) -> None:
    assert Assignment(3, owners).validate(3, live) == expected


def test_a_pid_claimed_by_two_instances_is_double_owned() -> None:
    claims = {"b": [1, 2], "a": [0, 1]}
    assert validate_claims(claims, 3, ["a", "b"]) == [AssignmentError.DOUBLE_OWNED_PID]
    assert Assignment(0, {0: "a", 1: "a", 2: "b"}).violations(3, ["a", "b"]) == []


def test_violations_name_the_pid_and_every_owner() -> None:
    claims = {"b": [1, 2], "a": [0, 1], "dead": [3]}
    assert find_violations(claims, 5, ["a", "b"]) == [
        Violation(AssignmentError.MISSING_PID, 4, None),
        Violation(AssignmentError.DOUBLE_OWNED_PID, 1, "a"),
        Violation(AssignmentError.DOUBLE_OWNED_PID, 1, "b"),
        Violation(AssignmentError.DEAD_OWNER, 3, "dead"),
    ]


def test_with_moves_bumps_the_epoch_and_leaves_the_original_alone() -> None:
    before = initial_assignment(4, ["a", "b"])
    after = before.with_moves([Move(1, "a", "b", HandoffMode.REPLAY), Move(2, "b", "a")])
    assert after.epoch == before.epoch + 1
    assert after.pids_of("a") == (0, 2)
    assert after.pids_of("b") == (1, 3)
    assert before.pids_of("a") == (0, 1)
    assert after.validate(4, ["a", "b"]) == []


def test_with_no_moves_is_the_same_assignment() -> None:
    before = initial_assignment(4, ["a", "b"])
    assert before.with_moves([]) is before


@pytest.mark.parametrize(
    "moves",
    [
        pytest.param([Move(0, "b", "a")], id="source-is-not-the-owner"),
        pytest.param([Move(0, "a", "b"), Move(0, "b", "a")], id="same-pid-twice"),
        pytest.param([Move(9, "a", "b")], id="unowned-pid"),
    ],
)
def test_with_moves_refuses(moves: list[Move]) -> None:
    with pytest.raises(ValueError):
        initial_assignment(4, ["a", "b"]).with_moves(moves)


@pytest.mark.parametrize(
    ("pid", "source", "target"),
    [pytest.param(-1, "a", "b", id="negative-pid"), pytest.param(0, "a", "a", id="to-itself")],
)
def test_move_rejects(pid: int, source: str, target: str) -> None:
    with pytest.raises(ValueError):
        Move(pid, source, target)


def test_assignment_is_immutable_ordered_and_hashable() -> None:
    owners = {2: "b", 0: "a", 1: "a"}
    assignment = Assignment(5, owners)
    owners[3] = "c"
    assert list(assignment.owners) == [0, 1, 2]
    with pytest.raises(TypeError):
        assignment.owners[0] = "z"  # type: ignore[index]
    assert assignment == Assignment(5, {0: "a", 1: "a", 2: "b"})
    assert hash(assignment) == hash(Assignment(5, {0: "a", 1: "a", 2: "b"}))
    assert assignment.by_instance() == {"a": (0, 1), "b": (2,)}
