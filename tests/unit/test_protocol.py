"""The control protocol's messages, codec and log fold (pure)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.fold import synthetic_log
from pipeline.control_view import ControlView, Fold, Message, SnapshotMsg, fold, moves_of
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    CommitMarker,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ProtocolError,
    ReleasedMsg,
    Snapshot,
)
from pipeline.protocol_codec import decode, encode, marker_from_json, marker_to_json

SNAP = Snapshot(topic="p.handoff", partition=0, offsets=(4, 5), sha256="ab" * 32)
MOVE = MoveSpec(move_id="m1", pid=3, source="a", target="b", mode=Mode.TRANSFER)
HANDOFF = Handoff(move_id="m1", mode=Mode.TRANSFER, cutoff={"A": 10, "B": 12}, snapshot=SNAP)
ANNOUNCED = ReleasedMsg(
    instance="a",
    epoch=1,
    pid=3,
    move_id="m1",
    cutoff={"A": 9},
    announced=True,
)


@pytest.mark.parametrize(
    "msg",
    [
        pytest.param(AssignmentMsg(epoch=0, owners={0: "a", 1: "b"}), id="plain-assignment"),
        pytest.param(
            AssignmentMsg(
                epoch=5, owners={0: "a"}, moving={3: MOVE}, handoffs={1: HANDOFF}, evicted=("c@x",)
            ),
            id="full-assignment",
        ),
        pytest.param(
            ReleasedMsg(instance="a", epoch=5, pid=3, move_id="m1", cutoff={"A": 1}, snapshot=SNAP),
            id="released",
        ),
        pytest.param(
            ReleasedMsg(instance="a", epoch=5, pid=3, move_id="m1", cutoff={"A": 1}), id="released-replay"
        ),
        pytest.param(ANNOUNCED, id="released-announced"),
        pytest.param(AcquiredMsg(instance="b", epoch=6, pid=3, move_id="m1"), id="acquired"),
        pytest.param(
            AssignmentMsg(
                epoch=7,
                owners={1: "b"},
                handoffs={
                    1: Handoff(
                        move_id="r1", mode=Mode.REPLAY, cutoff={"A": 90}, spilled=({"A": 40}, {"A": 70})
                    )
                },
            ),
            id="recovery-of-a-pid-spilled-twice",
        ),
        pytest.param(MoveRequestMsg(request_id="r", pids=(1, 2), target="c", mode=Mode.REPLAY), id="request"),
    ],
)
def test_every_message_round_trips(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        pytest.param(b"not json", "malformed", id="not-json"),
        pytest.param(b'{"version": 1, "kind": "gossip"}', "unknown", id="unknown-kind"),
        pytest.param(b'{"version": 9, "kind": "acquired"}', "newer", id="newer-version"),
        pytest.param(b'{"version": 1, "kind": "acquired", "pid": 1}', "malformed", id="missing-field"),
    ],
)
def test_bad_messages_are_refused_with_a_reason(raw: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        decode(raw)


def test_an_older_epoch_never_replaces_a_newer_assignment() -> None:
    new = AssignmentMsg(epoch=3, owners={0: "b"})
    view = fold([new, AssignmentMsg(epoch=2, owners={0: "a"})])
    assert view.assignment == new


def test_requests_are_pending_until_an_assignment_starts_their_move() -> None:
    request = MoveRequestMsg(request_id="r", pids=(3, 4), target="b", mode=Mode.TRANSFER)
    view = fold([AssignmentMsg(epoch=0, owners={3: "a", 4: "a"}), request])
    assert view.pending_requests() == [(request, 3), (request, 4)]
    started = MoveSpec(move_id=request.move_id(3), pid=3, source="a", target="b", mode=Mode.TRANSFER)
    view = view.apply(AssignmentMsg(epoch=1, owners={4: "a"}, moving={3: started}))
    rest = replace(request, pids=(4,))
    assert view.pending_requests() == [(rest, 4)], "a request keeps the pids not started"
    # Still served after the move left the newest assignment.
    view = view.apply(AssignmentMsg(epoch=2, owners={3: "b", 4: "a"}))
    assert view.pending_requests() == [(rest, 4)]
    other = replace(started, move_id=request.move_id(4), pid=4)
    view = view.apply(AssignmentMsg(epoch=3, owners={3: "b"}, moving={4: other}))
    assert view.requests == (), "a request whose moves have all started is over"


def test_acknowledgements_are_kept_by_move_id() -> None:
    released = ReleasedMsg(instance="a", epoch=1, pid=3, move_id="m1", cutoff={"A": 1})
    acquired = AcquiredMsg(instance="b", epoch=2, pid=3, move_id="m1")
    view = ControlView().apply(released).apply(acquired)
    assert view.released == {"m1": released} and view.acquired == {"m1": acquired}


def test_pids_of_lists_only_owned_pids() -> None:
    msg = AssignmentMsg(epoch=1, owners={0: "a", 2: "a", 1: "b"}, moving={3: MOVE})
    assert msg.pids_of("a") == frozenset({0, 2})


COMMITTED = replace(ANNOUNCED, announced=False)


def test_a_committed_release_outranks_its_announcement_in_either_order() -> None:
    for order in ([ANNOUNCED, COMMITTED], [COMMITTED, ANNOUNCED]):
        view = fold([AssignmentMsg(epoch=1, owners={}, moving={3: MOVE}), *order])
        assert view.released == {"m1": COMMITTED}


def test_two_different_assignments_with_one_epoch_are_refused() -> None:
    """One epoch, one map: a second, different assignment under it means two writers (or a retry that
    planned from a view without the first), and a reader keeping either would follow half the pipeline."""
    first = AssignmentMsg(epoch=3, owners={0: "a"}, moving={3: MOVE})
    with pytest.raises(ProtocolError, match="epoch 3"):
        fold([first, AssignmentMsg(epoch=3, owners={0: "b"})])
    assert fold([first, decode(encode(first))]).assignment == first, "a re-delivery is the same assignment"


def test_a_late_acknowledgement_of_an_abandoned_move_is_ignored() -> None:
    """Once no assignment refers to a move, nothing can act on its acknowledgements: the source of an
    abandoned move (recovered elsewhere while it stalled) announcing its release late changes nothing."""
    started = AssignmentMsg(epoch=1, owners={0: "a"}, moving={3: MOVE})
    recovery = Handoff(move_id="recover-1", mode=Mode.REPLAY, cutoff={"A": 0})
    recovered = AssignmentMsg(epoch=2, owners={0: "a", 3: "c"}, handoffs={3: recovery})
    view = fold([started, recovered, COMMITTED])
    assert "m1" not in view.released and "m1" not in view.acquired


def test_folding_a_long_log_stays_right_and_bounded() -> None:
    """A pipeline that has moved pids for weeks must restart: the view keeps what a move in flight or a
    pending request needs (and the newest finished moves, for whoever waits on them), not the history."""
    log, owners = synthetic_log(15_000)
    assert len(log) > 100_000
    view, sizes = ControlView(), []
    for start in range(0, len(log), 10_000):
        view = fold(log[start : start + 10_000], view)
        sizes.append(len(view.released) + len(view.acquired) + len(view.track_done) + len(view.started))
        sizes[-1] += len(view.requests)
        assert sizes[-1] < 8_000, f"the view grows with the log: {sizes}"
    assert max(sizes[1:]) - min(sizes[1:]) < 20, f"steady moves, steady size: {sizes}"
    assert view.assignment is not None and dict(view.assignment.owners) == owners
    assert view.assignment.epoch == sum(isinstance(m, AssignmentMsg) for m in log) - 1
    assert view.pending_requests() == []
    assert all(a.instance != "zombie" for a in view.acquired.values()), "a finished move's late ack counts"
    newest = "m14999"
    assert view.acquired[newest].instance == owners[14_999 % 64], "the newest finished moves stay readable"


def _moves_cut_after_a_release(moves: int) -> tuple[list[Message], int]:
    """A log of `moves` moves and the index of its last move's `Released` (the move is in flight there)."""
    log, _ = synthetic_log(moves)
    return log, max(i for i, m in enumerate(log) if isinstance(m, ReleasedMsg))


def test_a_snapshot_round_trips_with_what_a_step_needs_only() -> None:
    log, released_at = _moves_cut_after_a_release(40)
    view = fold(log[: released_at + 1])
    snapshot = SnapshotMsg(view=view.pruned(), read_to=released_at + 1)
    assert decode(encode(snapshot)) == snapshot
    assert view.assignment is not None and set(snapshot.view.released) == set(moves_of(view.assignment))
    assert not snapshot.view.acquired and len(view.acquired) == 39, "finished moves stay out"


def test_a_fold_without_the_log_prefix_takes_the_state_from_a_snapshot() -> None:
    """The records before `first` are deleted; the controller wrote a snapshot after them, without the
    `Released` just before it (hidden from it by an open transaction). The fold of what is left, once
    past the snapshot, says what the fold of the whole log says."""
    log, released_at = _moves_cut_after_a_release(300)
    snapshot = SnapshotMsg(view=fold(log[:released_at]).pruned(), read_to=released_at)
    first = released_at - 3
    partial = Fold(complete=False)
    for msg in log[first : released_at + 1]:
        partial.add(msg)
    assert not partial.complete, "no snapshot yet: the state before the deleted records is unknown"
    for msg in [snapshot, *log[released_at + 1 :]]:
        partial.add(msg)
    assert partial.complete
    assert partial.view().pruned() == fold(log).pruned()


def test_a_snapshot_merges_into_a_view_in_either_order() -> None:
    log, released_at = _moves_cut_after_a_release(300)
    request = MoveRequestMsg(request_id="late", pids=(1, 2), target="i-0", mode=Mode.REPLAY)
    known = fold(log[:released_at]).pruned()
    seen = fold([*log[released_at - 3 : released_at + 1], request])
    assert known.merge(seen) == seen.merge(known)
    merged = known.merge(seen)
    assert merged.assignment == known.assignment and "m299" in merged.released
    assert merged.pending_requests() == [(request, 1), (request, 2)]


def test_a_commit_marker_reads_back_as_written_and_names_its_cutoffs() -> None:
    offsets = {"A": {1: 40, 7: 3}, "B": {1: 38, 7: 5}}
    marker = CommitMarker(instance="i0", incarnation="x", batch=12, epoch=4, offsets=offsets, time_ms=99)
    written = json.loads(json.dumps(marker_to_json(marker)))
    assert written["offsets"] == {"A": {"1": 40, "7": 3}, "B": {"1": 38, "7": 5}}  # str pids, as ever
    assert marker_from_json(written) == marker
    assert marker.pids() == {1, 7}
    assert marker.cutoffs() == {1: {"A": 40, "B": 38}, 7: {"A": 3, "B": 5}}


def test_spill_points_read_back_as_written_and_from_the_single_point_written_before() -> None:
    """A pid spilled twice carries two points; a marker or handoff written before a pid could spill
    again holds one mapping, which reads as one point."""
    spilled = {7: ({"A": 1, "B": 2}, {"A": 3, "B": 4})}
    marker = CommitMarker(
        instance="i0", incarnation="x", batch=1, epoch=1, offsets={"A": {7: 5}}, time_ms=1, spilled=spilled
    )
    assert marker_from_json(json.loads(json.dumps(marker_to_json(marker)))) == marker
    older = marker_to_json(marker) | {"spilled": {"7": {"A": 1, "B": 2}}}
    assert marker_from_json(older).spilled == {7: ({"A": 1, "B": 2},)}
