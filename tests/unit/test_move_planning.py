"""`plan_step`, the controller's protocol driver, as a pure function: each step of a move, idempotence,
recovery of dead instances and rejoining."""

from __future__ import annotations

from collections.abc import Mapping

from controller.moves import Liveness, plan_step
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    ControlView,
    Handoff,
    Mode,
    MoveSpec,
    ReleasedMsg,
    Snapshot,
    fold,
)

LIVE = Liveness(live={"a": "ia", "b": "ib", "c": "ic"}, dead=frozenset())
START = AssignmentMsg(epoch=0, owners={0: "a", 1: "a", 2: "b", 3: "c"})
MOVE = MoveSpec(move_id="m1", pid=1, source="a", target="b", mode=Mode.TRANSFER)
SNAP = Snapshot(topic="t", partition=0, offsets=(7,), sha256="00" * 32)


def committed(instance: str, pid: int) -> Mapping[str, int] | None:
    return {"A": 100 + pid, "B": 200 + pid} if instance == "a" else None


def earliest(pid: int) -> Mapping[str, int]:
    return {"A": 0, "B": 0}


def step(
    view: ControlView, liveness: Liveness = LIVE, requested: list[MoveSpec] | None = None
) -> AssignmentMsg | None:
    msg, _ = plan_step(view, liveness, requested or [], committed, earliest)
    return msg


def test_a_move_goes_in_transit_then_to_the_target_then_settles() -> None:
    view = fold([START])
    first = step(view, requested=[MOVE])
    assert first is not None and first.epoch == 1
    assert 1 not in first.owners and first.moving == {1: MOVE}
    view = view.apply(first)
    assert step(view, requested=[MOVE]) is None, "nothing new until the source releases"

    view = view.apply(
        ReleasedMsg(instance="a", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    )
    second = step(view)
    assert second is not None and second.epoch == 2
    assert second.owners[1] == "b" and not second.moving
    assert second.handoffs[1] == Handoff(
        move_id="m1", mode=Mode.TRANSFER, cutoff={"A": 5, "B": 6}, snapshot=SNAP
    )
    view = view.apply(second)
    assert step(view) is None, "nothing new until the target acquires"

    view = view.apply(AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1"))
    third = step(view)
    assert third is not None and third.epoch == 3 and not third.handoffs and third.owners[1] == "b"
    view = view.apply(third)
    assert step(view, requested=[MOVE]) is None, "a started move is never started again"


def test_moves_of_unowned_pids_or_to_dead_targets_are_not_started() -> None:
    view = fold([START])
    wrong_source = MoveSpec(move_id="x", pid=2, source="a", target="c", mode=Mode.REPLAY)
    to_stranger = MoveSpec(move_id="y", pid=0, source="a", target="zz", mode=Mode.REPLAY)
    msg, said = plan_step(view, LIVE, [wrong_source, to_stranger], committed, earliest)
    assert msg is None
    assert any("zz is not live" in line for line in said)


def test_a_dead_owner_loses_its_pids_by_replay_from_its_committed_offsets() -> None:
    view = fold([START])
    dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    msg = step(view, dead)
    assert msg is not None
    assert {msg.owners[0], msg.owners[1]} <= {"b", "c"}
    assert msg.owners[0] != msg.owners[1], "spread over the least loaded survivors"
    for p in (0, 1):
        h = msg.handoffs[p]
        assert h.mode is Mode.REPLAY and dict(h.cutoff) == {"A": 100 + p, "B": 200 + p}
    assert msg.evicted == ("a@ia",), "names the incarnation, which wipes its checkpoint on return"


def test_a_dead_target_is_replaced_before_the_source_releases() -> None:
    view = fold([START, AssignmentMsg(epoch=1, owners={0: "a", 2: "b", 3: "c"}, moving={1: MOVE})])
    msg = step(view, Liveness(live={"a": "ia", "c": "ic"}, dead=frozenset({"b"})))
    assert msg is not None
    assert msg.moving[1].target == "c" and msg.moving[1].move_id == "m1"
    assert msg.owners[2] == "a" and msg.handoffs[2].cutoff == {"A": 0, "B": 0}, (
        "c got the retargeted move; b never committed pid 2"
    )


def test_a_handoff_never_taken_moves_on_with_its_cutoff() -> None:
    handoff = Handoff(move_id="m1", mode=Mode.TRANSFER, cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    view = fold([AssignmentMsg(epoch=2, owners={0: "a", 1: "b", 2: "b", 3: "c"}, handoffs={1: handoff})])
    msg = step(view, Liveness(live={"a": "ia", "c": "ic"}, dead=frozenset({"b"})))
    assert msg is not None and msg.owners[1] in {"a", "c"} and msg.handoffs[1] == handoff


def test_an_evicted_instance_rejoins_under_a_new_incarnation_only() -> None:
    view = fold([AssignmentMsg(epoch=4, owners={0: "b"}, evicted=("a@old",))])
    same = Liveness(live={"a": "old", "b": "ib"}, dead=frozenset())
    assert step(view, same) is None
    back = step(view, Liveness(live={"a": "new", "b": "ib"}, dead=frozenset()))
    assert back is not None and back.evicted == ()


def test_no_assignment_means_nothing_to_do() -> None:
    assert step(ControlView(), requested=[MOVE]) is None


def test_a_dead_instance_without_pids_is_evicted_once() -> None:
    view = fold([AssignmentMsg(epoch=3, owners={0: "b", 1: "b", 2: "b", 3: "c"})])
    dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    msg = step(view, dead)
    assert msg is not None and msg.evicted == ("a@ia",) and dict(msg.owners) == dict(view.assignment.owners)  # type: ignore[union-attr]
    assert step(view.apply(msg), dead) is None, "evicted once"
