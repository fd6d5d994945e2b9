"""The controller's step (`plan_step`) over the grid of a moved pid's states and the events that can
meet each, per handoff mode: the tables of docs/architecture.md ("The protocol as state machines"),
row by row. Pid 1 moves from a to b; c is the third instance. An event is an acknowledgement from the
instance the state waits for or from another one (a zombie), an instance's death (a crash at that step),
or a controller restart (the view folded again from the log: the same next step, and a step on a view
that already holds it publishes nothing)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest

from controller.moves.driver import plan_step
from controller.observation.liveness import Liveness
from pipeline.control_view import Message, fold
from pipeline.protocol import (
    AcquiredMsg,
    AssignmentMsg,
    Handoff,
    Mode,
    MoveSpec,
    ReleasedMsg,
    Snapshot,
    TrackDoneMsg,
)

NAMES = ("a", "b", "c")
START = AssignmentMsg(epoch=0, owners={0: "a", 1: "a", 2: "b", 3: "c"})
CUTOFF = {"A": 5, "B": 6}
MARKERS: Mapping[str, Mapping[int, Mapping[str, int]]] = {
    "a": {0: {"A": 40, "B": 50}, 1: {"A": 41, "B": 51}},
    "b": {2: {"A": 42, "B": 52}},
    "c": {3: {"A": 43, "B": 53}},
}
"""Each instance's newest commit marker: the pids it held at epoch 0."""
SNAP = Snapshot(topic="t", partition=0, offsets=(7,), sha256="00" * 32)
RECOVERY_IDS = itertools.count()


def new_id() -> str:
    """A move id never used before, for a recovery handoff (`plan_step`'s `new_id`)."""
    return f"recover-{next(RECOVERY_IDS)}"


def alive(*dead: str) -> Liveness:
    return Liveness(
        live={i: f"i{i}" for i in NAMES if i not in dead},
        dead=frozenset(dead),
        incarnations={i: f"i{i}" for i in NAMES},
    )


def step(
    log: list[Message], liveness: Liveness, requested: list[MoveSpec] | None = None
) -> AssignmentMsg | None:
    return plan_step(fold(log), liveness, requested or [], MARKERS, lambda p: {"A": 0, "B": 0}, new_id)[0]


def move(mode: Mode) -> MoveSpec:
    return MoveSpec(move_id="m1", pid=1, source="a", target="b", mode=mode)


def released(mode: Mode, by: str = "a") -> ReleasedMsg:
    snapshot = SNAP if mode is Mode.TRANSFER else None
    stream_max = (9, 9) if mode is Mode.PARALLEL_TRACK else None
    return ReleasedMsg(
        instance=by, epoch=1, pid=1, move_id="m1", cutoff=CUTOFF, snapshot=snapshot, stream_max=stream_max
    )


def advance(log: list[Message], liveness: Liveness, requested: list[MoveSpec] | None = None) -> list[Message]:
    """The log after the controller's next step (which must publish)."""
    nxt = step(log, liveness, requested)
    assert nxt is not None, "the state must advance"
    return [*log, nxt]


def states(mode: Mode) -> dict[str, list[Message]]:
    """Each state of the mode's table, as the log that reaches it."""
    live = alive()
    moving = advance([START], live, [move(mode)])
    handed = advance([*moving, released(mode)], live)
    out: dict[str, list[Message]] = {"moving": moving, "handed off": handed}
    if mode is Mode.PARALLEL_TRACK:
        tracked = advance([*handed, AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1")], live)
        old_done = TrackDoneMsg(instance="a", epoch=3, pid=1, move_id="m1", side="old")
        out["tracked"] = tracked
        out["old side done"] = advance([*tracked, old_done], live)
    return out


@dataclass(frozen=True)
class Pid1:
    """What the assignment says of pid 1."""

    owner: str | None
    moving: tuple[str, str] | None = None
    handoff: bool = False
    track: tuple[str, str] | None = None


def pid_1(a: AssignmentMsg) -> Pid1:
    m, t = a.moving.get(1), a.tracks.get(1)
    return Pid1(
        owner=a.owners.get(1),
        moving=(m.source, m.target) if m else None,
        handoff=1 in a.handoffs,
        track=(t.source, t.target) if t else None,
    )


Event = Callable[[Mode], tuple[list[Message], Liveness]]


def ack(msg: Callable[[Mode], Message]) -> Event:
    return lambda mode: ([msg(mode)], alive())


def dies(name: str) -> Event:
    return lambda mode: ([], alive(name))


UNCHANGED = None
T, R, PT = Mode.TRANSFER, Mode.REPLAY, Mode.PARALLEL_TRACK
ACQUIRED_B = ack(lambda m: AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1"))
ACQUIRED_C = ack(lambda m: AcquiredMsg(instance="c", epoch=2, pid=1, move_id="m1"))

GRID: list[tuple[tuple[Mode, ...], str, str, Event, Pid1 | None]] = [
    # modes, state, event, the event, pid 1 afterwards (None: nothing published)
    ((T, R), "moving", "Released from the source", ack(released), Pid1("b", handoff=True)),
    ((PT,), "moving", "Released from the source", ack(released), Pid1("b", handoff=True, track=("a", "b"))),
    ((T, R, PT), "moving", "Released from another", ack(lambda m: released(m, by="c")), UNCHANGED),
    ((T, R, PT), "moving", "the target dies", dies("b"), Pid1(None, moving=("a", "c"))),
    ((T, R), "moving", "the source dies", dies("a"), Pid1("c", handoff=True)),
    ((T, R), "handed off", "Acquired from the target", ACQUIRED_B, Pid1("b")),
    ((T, R, PT), "handed off", "Acquired from another", ACQUIRED_C, UNCHANGED),
    ((T, R), "handed off", "the target dies", dies("b"), Pid1("a", handoff=True)),  # least loaded
    ((PT,), "handed off", "Acquired from the target", ACQUIRED_B, Pid1("b", track=("a", "b"))),
    (
        (PT,),
        "tracked",
        "TrackDone old from the source",
        ack(lambda m: TrackDoneMsg(instance="a", epoch=3, pid=1, move_id="m1", side="old")),
        Pid1("b", track=("", "b")),
    ),
    (
        (PT,),
        "tracked",
        "TrackDone old from another",
        ack(lambda m: TrackDoneMsg(instance="c", epoch=3, pid=1, move_id="m1", side="old")),
        UNCHANGED,
    ),
    (
        (PT,),
        "tracked",
        "TrackDone new before the old side's",
        ack(lambda m: TrackDoneMsg(instance="b", epoch=3, pid=1, move_id="m1", side="new")),
        UNCHANGED,
    ),
    ((PT,), "tracked", "the old side dies", dies("a"), Pid1("b", track=("c", "b"))),
    ((PT,), "tracked", "the new side dies", dies("b"), Pid1("c", handoff=True, track=("a", "c"))),
    (
        (PT,),
        "old side done",
        "TrackDone new from the target",
        ack(lambda m: TrackDoneMsg(instance="b", epoch=4, pid=1, move_id="m1", side="new")),
        Pid1("b"),
    ),
    (
        (PT,),
        "old side done",
        "TrackDone new from another",
        ack(lambda m: TrackDoneMsg(instance="c", epoch=4, pid=1, move_id="m1", side="new")),
        UNCHANGED,
    ),
]

CELLS = [
    pytest.param(mode, state, event, expected, id=f"{mode.value}: {state}: {what}")
    for modes, state, what, event, expected in GRID
    for mode in modes
]


@pytest.mark.parametrize(("mode", "state", "event", "expected"), CELLS)
def test_each_state_and_event_of_a_move(mode: Mode, state: str, event: Event, expected: Pid1 | None) -> None:
    messages, liveness = event(mode)
    log = [*states(mode)[state], *messages]
    nxt = step(log, liveness)
    if expected is None:
        assert nxt is None, "an acknowledgement from an instance the state does not wait for is ignored"
        return
    assert nxt is not None and pid_1(nxt) == expected
    # A controller killed right after publishing: its successor folds the log, which holds the step.
    assert step([*log, nxt], liveness) is None, "a step taken is never taken twice"


def test_a_handoff_whose_target_died_keeps_its_cutoff_under_a_new_move_id() -> None:
    """The new owner starts where the dead one would have, under a move id a late `Acquired` of the dead
    target cannot end."""
    log = states(T)["handed off"]
    nxt = step(log, alive("b"))
    assert nxt is not None
    assert nxt.handoffs[1].cutoff == CUTOFF and nxt.handoffs[1].snapshot == SNAP
    assert nxt.handoffs[1].move_id != "m1"
    zombie = AcquiredMsg(instance="b", epoch=2, pid=1, move_id="m1")
    assert step([*log, nxt, zombie], alive("b")) is None, "the dead target's late Acquired changes nothing"


def test_a_source_that_dies_in_transit_is_replayed_from_its_marker() -> None:
    nxt = step(states(R)["moving"], alive("a"))
    assert nxt is not None
    assert nxt.handoffs[1] == Handoff(
        move_id=nxt.handoffs[1].move_id, mode=Mode.REPLAY, cutoff={"A": 41, "B": 51}
    )
