"""`plan_step`, the controller's protocol driver, as a pure function: each step of a move, idempotence,
recovery of dead instances and rejoining."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

from controller.moves.driver import plan_step
from controller.moves.views import finished_moves, moves_in_flight, moves_releasing, requested_moves
from controller.observation.liveness import Liveness
from pipeline.control_view import ControlView, fold
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ReleasedMsg,
    Snapshot,
    TrackDoneMsg,
)
from pipeline.protocol_codec import decode, encode

LIVE = Liveness(live={"a": "ia", "b": "ib", "c": "ic"}, dead=frozenset())
START = AssignmentMsg(epoch=0, owners={0: "a", 1: "a", 2: "b", 3: "c"})
MOVE = MoveSpec(move_id="m1", pid=1, source="a", target="b", mode=Mode.TRANSFER)
SNAP = Snapshot(topic="t", partition=0, offsets=(7,), sha256="00" * 32)


MARKERS: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "a": {p: {"A": 100 + p, "B": 200 + p} for p in range(4)}
}
"""Each instance's newest commit marker, per pid: "a" committed all four pids, the others nothing."""


def earliest(pid: int) -> Mapping[str, int]:
    return {"A": 0, "B": 0}


RECOVERY_IDS = itertools.count()


def new_id() -> str:
    """A move id never used before, for a recovery handoff (`plan_step`'s `new_id`)."""
    return f"recover-{next(RECOVERY_IDS)}"


def plan(
    view: ControlView,
    liveness: Liveness = LIVE,
    requested: list[MoveSpec] | None = None,
    markers: Mapping[str, Mapping[int, Mapping[str, int]]] = MARKERS,
) -> tuple[AssignmentMsg | None, list[str]]:
    return plan_step(view, liveness, requested or [], markers, earliest, new_id)


def step(
    view: ControlView, liveness: Liveness = LIVE, requested: list[MoveSpec] | None = None
) -> AssignmentMsg | None:
    return plan(view, liveness, requested)[0]


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
    msg, said = plan_step(view, LIVE, [wrong_source, to_stranger], MARKERS, earliest, new_id)
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
    assert msg is not None and msg.owners[1] in {"a", "c"}
    assert msg.handoffs[1] == replace(handoff, move_id=msg.handoffs[1].move_id) != handoff, (
        "its cutoff and snapshot, under a move id of its own"
    )


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
    msg, said = plan_step(view, only_a, [], MARKERS, earliest, new_id)
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


def test_an_instance_evicted_under_the_incarnation_it_still_runs_is_no_target() -> None:
    """It was declared dead during a stall and will exit as soon as it notices: pids moved onto it
    would be read by nobody, or from the log start once it restarts empty."""
    view = fold([AssignmentMsg(epoch=4, owners={0: "b", 1: "c"}, evicted=("a@ia",))])
    to_a = MoveSpec(move_id="z", pid=0, source="b", target="a", mode=Mode.REPLAY)
    msg, said = plan(view, LIVE, [to_a])
    assert msg is None, "a move onto a is refused"
    assert any("a is not live" in line for line in said)
    c_dead = Liveness(live={"a": "ia", "b": "ib"}, dead=frozenset({"c"}), incarnations={"c": "ic"})
    recovered = step(view, c_dead)
    assert recovered is not None and recovered.owners[1] == "b", "nor the target of a recovery"


def test_an_instance_that_rejoins_while_the_assignment_gives_it_pids_gets_them_recovered() -> None:
    """Its new incarnation started empty: the pids its evicted incarnation still owned in the assignment
    are replayed from that incarnation's committed offsets, not read from the log start."""
    view = fold([AssignmentMsg(epoch=4, owners={0: "a", 1: "a", 2: "b"}, evicted=("a@old",))])
    msg = step(view, Liveness(live={"a": "new", "b": "ib"}, dead=frozenset()))
    assert msg is not None
    for p in (0, 1):
        h = msg.handoffs[p]
        assert h.mode is Mode.REPLAY and dict(h.cutoff) == {"A": 100 + p, "B": 200 + p}
    assert msg.evicted == ("a@old",), "a rejoins once its old incarnation holds nothing"
    back = step(view.apply(msg), Liveness(live={"a": "new", "b": "ib"}, dead=frozenset()))
    assert back is not None and back.evicted == ()


def test_a_dead_instance_evicted_earlier_that_still_owns_pids_loses_them() -> None:
    view = fold([AssignmentMsg(epoch=4, owners={0: "a", 1: "b", 2: "b", 3: "c"}, evicted=("a@ia",))])
    a_dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    msg = step(view, a_dead)
    assert msg is not None and msg.owners[0] in {"b", "c"}
    assert dict(msg.handoffs[0].cutoff) == {"A": 100, "B": 200} and msg.evicted == ("a@ia",)


def test_a_pid_missing_from_the_marker_of_an_instance_that_committed_waits_rather_than_replay_the_log() -> (
    None
):
    """Only an instance that never committed anything falls back to the log start: a marker without the
    pid (its release committed but not visible yet, a marker hidden behind an open transaction) does not
    say where the pid's committed output ends."""
    view = fold([START])
    a_dead = Liveness(live={"b": "ib", "c": "ic"}, dead=frozenset({"a"}), incarnations={"a": "ia"})
    msg, said = plan(view, a_dead, markers={"a": {0: {"A": 100, "B": 200}}})
    assert msg is not None and dict(msg.handoffs[0].cutoff) == {"A": 100, "B": 200}
    assert msg.owners.get(1) == "a" and 1 not in msg.handoffs, "pid 1 waits"
    assert any("pid 1" in line and "waiting" in line for line in said)


def test_acknowledgements_count_only_from_the_instance_the_step_waits_for() -> None:
    view = fold([START])
    view = view.apply(view_step_with(view, [MOVE]))
    stranger = ReleasedMsg(instance="c", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    assert step(view.apply(stranger)) is None, "only the source releases"
    view = view.apply(
        ReleasedMsg(instance="a", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    )
    view = view.apply(view_step(view))
    assert step(view.apply(AcquiredMsg(instance="c", epoch=2, pid=1, move_id="m1"))) is None, (
        "only the new owner acquires"
    )
    track = _overlap()
    done_elsewhere = TrackDoneMsg(instance="c", epoch=3, pid=1, move_id="pt", side="old")
    assert step(track.apply(done_elsewhere)) is None, "only the old side's holder ends it"


def test_a_zombie_acquired_for_a_handoff_given_to_another_owner_is_ignored() -> None:
    """b died before taking pid 1; its handoff goes on to another owner under a move id of its own, so a
    late `Acquired` from b (whose transaction committed before it was fenced) does not drop it."""
    handoff = Handoff(move_id="m1", mode=Mode.TRANSFER, cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    view = fold([AssignmentMsg(epoch=2, owners={0: "a", 1: "b", 2: "b", 3: "c"}, handoffs={1: handoff})])
    b_dead = Liveness(live={"a": "ia", "c": "ic"}, dead=frozenset({"b"}), incarnations={"b": "ib"})
    msg = step(view, b_dead)
    assert msg is not None
    view = view.apply(msg).apply(AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1"))
    assert step(view, b_dead) is None, "the new owner's handoff stays until it acquires"


def test_a_move_whose_target_died_is_never_retargeted_onto_its_source() -> None:
    """With no other live instance the move waits for its source's release (which may already be
    committed, unseen), then the pid goes back to the source by a handoff from its own cutoff."""
    view = fold([AssignmentMsg(epoch=1, owners={0: "a", 2: "b", 3: "c"}, moving={1: MOVE})])
    only_a = Liveness(live={"a": "ia"}, dead=frozenset({"b", "c"}), incarnations={"b": "ib", "c": "ic"})
    msg = step(view, only_a)
    assert msg is not None and msg.moving[1].target != "a"
    view = view.apply(msg).apply(
        ReleasedMsg(instance="a", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    )
    a = view_step(view, only_a)
    assert a.owners[1] == "a" and not a.moving
    assert a.handoffs[1].cutoff == {"A": 5, "B": 6} and a.handoffs[1].snapshot == SNAP


def test_a_move_from_an_instance_to_itself_found_in_the_log_fails_nothing() -> None:
    """An assignment no controller writes now (an older one did): the controller reads and continues it
    rather than fail on it at every restart."""
    to_itself = replace(MOVE, target="a")
    view = fold([AssignmentMsg(epoch=1, owners={0: "a", 2: "b", 3: "c"}, moving={1: to_itself})])
    assert moves_in_flight(view) == []
    assert step(view, requested=[replace(MOVE, move_id="m2", pid=0, target="a")]) is None
    released = ReleasedMsg(instance="a", epoch=1, pid=1, move_id="m1", cutoff={"A": 5, "B": 6}, snapshot=SNAP)
    msg = step(view.apply(released))
    assert msg is not None and msg.owners[1] == "a" and msg.handoffs[1].cutoff == {"A": 5, "B": 6}


def test_a_move_request_past_its_expiry_is_dropped_not_served() -> None:
    """`fluxjoin move` gave up waiting at `expires_ms`: a controller that reads the request later (it was
    not running) must not serve it."""
    late = MoveRequestMsg(request_id="r1", pids=(1,), target="b", mode=Mode.REPLAY, expires_ms=1_000)
    fresh = MoveRequestMsg(request_id="r2", pids=(0,), target="c", mode=Mode.REPLAY, expires_ms=3_000)
    assert decode(encode(late)) == late
    moves, said = requested_moves(fold([START, late, fresh]), now_ms=2_000)
    assert [(m.move_id, m.pid, m.source, m.target) for m in moves] == [("r2-0", 0, "a", "c")]
    assert any("r1" in line and "expired" in line for line in said)
