"""The control protocol's messages, codec and log fold (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    ControlView,
    Handoff,
    Mode,
    MoveRequestMsg,
    MoveSpec,
    ProtocolError,
    ReleasedMsg,
    Snapshot,
    decode,
    encode,
    fold,
)

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
    assert view.pending_requests() == [(request, 4)]
    # Still served after the move left the newest assignment.
    view = view.apply(AssignmentMsg(epoch=2, owners={3: "b", 4: "a"}))
    assert view.pending_requests() == [(request, 4)]


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
        view = fold([AssignmentMsg(epoch=2, owners={3: "b"}), *order])
        assert view.released == {"m1": COMMITTED}
