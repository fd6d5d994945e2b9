"""`plan_step`, the controller's protocol driver, as a pure function: each step of a move, idempotence,
recovery of dead instances and rejoining."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from controller.moves import Liveness, finished_moves, moves_in_flight, moves_releasing, plan_step
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    ControlView,
    Handoff,
    Mode,
    MoveSpec,
    ReleasedMsg,
    Snapshot,
    TrackDoneMsg,
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


def test_a_replay_announced_at_its_plan_is_handed_over_at_once() -> None:
    replay = replace(MOVE, mode=Mode.REPLAY)
    view = fold([START])
    first = step(view, requested=[replay])
    assert first is not None
    announced = ReleasedMsg(
        instance="a",
        epoch=1,
        pid=1,
        move_id="m1",
        cutoff={"A": 9, "B": 9},
        announced=True,
    )
    second = step(view.apply(first).apply(announced))
    assert second is not None and second.owners[1] == "b"
    assert second.handoffs[1] == Handoff(move_id="m1", mode=Mode.REPLAY, cutoff={"A": 9, "B": 9})


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


PT = MoveSpec(move_id="pt", pid=1, source="a", target="b", mode=Mode.PARALLEL_TRACK)


def _overlap() -> ControlView:
    """Pid 1 in a parallel track: "a" holds its old tuples, "b" owns it from the cutoff."""
    view = fold([START])
    for msg in (
        step(view, requested=[PT]),
        ReleasedMsg(
            instance="a", epoch=1, pid=1, move_id="pt", cutoff={"A": 5, "B": 6}, stream_max=(900, 901)
        ),
    ):
        assert msg is not None
        view = view.apply(msg)
    second = step(view)
    assert second is not None
    return view.apply(second)


def test_a_parallel_track_keeps_both_sides_until_both_are_done() -> None:
    view = _overlap()
    a = view.assignment
    assert a is not None and a.owners[1] == "b" and a.tracks == {1: PT}
    assert a.handoffs[1].stream_max == (900, 901) and a.handoffs[1].since is None
    assert step(view, requested=[replace(PT, move_id="again", source="b", target="c")]) is None, (
        "no other move of a pid in a parallel track"
    )
    view = view.apply(AcquiredMsg(instance="b", epoch=2, pid=1, move_id="pt"))
    view = view.apply(view_step(view))
    view = view.apply(TrackDoneMsg(instance="a", epoch=3, pid=1, move_id="pt", side="old"))
    lets_go = step(view)
    assert lets_go is not None and lets_go.tracks[1].source == "", "the sender lets the pid go"
    view = view.apply(lets_go).apply(TrackDoneMsg(instance="b", epoch=4, pid=1, move_id="pt", side="new"))
    over = step(view)
    assert over is not None and not over.tracks


def test_a_dead_sender_of_a_parallel_track_is_resumed_on_a_third_instance() -> None:
    view = _overlap()
    a_dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    msg = step(view, a_dead)
    assert msg is not None and msg.tracks[1].source == "c", "never the receiver: its state key is taken"
    resume = msg.track_handoffs[1]
    assert resume.cutoff == {"A": 101, "B": 201} and resume.since == {"A": 5, "B": 6}
    assert resume.stream_max == (900, 901) and "a@ia" in msg.evicted


def test_a_dead_receiver_of_a_parallel_track_is_resumed_from_the_cutoff() -> None:
    view = _overlap()
    b_dead = Liveness(live={"a": "ia", "c": "ic"}, dead=frozenset({"b"}), incarnations={"b": "ib"})
    msg = step(view, b_dead)
    assert msg is not None and msg.owners[1] == "c" and msg.tracks[1].target == "c"
    assert msg.handoffs[1].mode is Mode.PARALLEL_TRACK and msg.handoffs[1].stream_max == (900, 901)


def test_a_dead_receiver_whose_part_of_the_overlap_ended_is_recovered_by_plain_replay() -> None:
    view = _overlap().apply(AcquiredMsg(instance="b", epoch=2, pid=1, move_id="pt"))
    view = view.apply(view_step(view))
    view = view.apply(TrackDoneMsg(instance="b", epoch=3, pid=1, move_id="pt", side="new"))
    b_dead = Liveness(live={"a": "ia", "c": "ic"}, dead=frozenset({"b"}), incarnations={"b": "ib"})
    msg = step(view, b_dead)
    assert msg is not None and msg.owners[1] == "c", "never the old side, which still holds pid 1's window"
    assert msg.tracks[1].source == "a" and msg.tracks[1].target == "c"
    assert msg.handoffs[1].mode is Mode.REPLAY and msg.handoffs[1].cutoff == {"A": 0, "B": 0}


def test_a_parallel_track_waits_for_a_third_instance_rather_than_share_one() -> None:
    view = _overlap()
    only_a = Liveness(live={"a": "ia"}, dead=frozenset({"b", "c"}), incarnations={"b": "ib", "c": "ic"})
    msg, said = plan_step(view, only_a, [], committed, earliest)
    assert msg is not None and "b@ib" not in msg.evicted and msg.owners[1] == "b"
    assert any("a parallel track needs two" in line for line in said)


def view_step(view: ControlView, liveness: Liveness = LIVE) -> AssignmentMsg:
    msg = step(view, liveness)
    assert msg is not None
    return msg


def test_a_move_finishes_once_when_the_target_has_acquired_it() -> None:
    view = fold([START])
    view = view.apply(view_step_with(view, [MOVE]))
    in_transit = moves_in_flight(view)
    assert [(m.pid, m.source, m.target) for m in in_transit] == [(1, "a", "b")]
    assert moves_releasing(view) == in_transit
    released = view.apply(
        ReleasedMsg(instance="a", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    )
    handed = released.apply(view_step(released))
    assert finished_moves(in_transit, handed) == [], "handed over, not yet taken"
    assert moves_releasing(handed) == [], "no longer its source's: a policy round may run"
    acquired = handed.apply(AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1"))
    done = acquired.apply(view_step(acquired))
    (finished,) = finished_moves(moves_in_flight(handed), done)
    assert (finished.move.pid, finished.epoch, finished.owner, finished.completed) == (1, 3, "b", True)
    assert finished_moves(moves_in_flight(done), done) == []


def test_a_move_whose_source_died_finishes_as_abandoned() -> None:
    view = fold([START])
    view = view.apply(view_step_with(view, [MOVE]))
    a_dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    recovered = view.apply(view_step(view, a_dead))
    (finished,) = [f for f in finished_moves(moves_in_flight(view), recovered) if f.move.pid == 1]
    assert finished.owner == "c" and not finished.completed, "recovered on the least loaded, not on b"


def view_step_with(view: ControlView, requested: list[MoveSpec]) -> AssignmentMsg:
    msg = step(view, requested=requested)
    assert msg is not None
    return msg
