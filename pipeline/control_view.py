"""The control log folded into the current view: `ControlView`, what the log says now; `Fold`, the log
folded in place; `SnapshotMsg`, the view written back into the log; and `Message`, any record of the log.

The messages are `pipeline.protocol`'s, their JSON codecs `pipeline.protocol_codec`'s. `SnapshotMsg`
carries a `ControlView`, so it and `Message` live here, over the messages they build on. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from pipeline.protocol import (
    PROTOCOL_VERSION,
    AcquiredMsg,
    AssignmentMsg,
    BudgetMsg,
    ConflictingAssignments,
    MoveRequestMsg,
    ReleasedMsg,
    SpillGateMsg,
    TrackDoneMsg,
    track_key,
)

RECENT_MOVES = 1000
"""How many finished moves a view keeps the acknowledgements of. No step reads them (a move is over once
no assignment refers to it); they are there for whoever waits on a move (`fluxjoin move` waits for its
`Acquired`, which the controller's next epoch already makes history)."""


def moves_of(a: AssignmentMsg) -> frozenset[str]:
    """The moves an assignment refers to: the only ones whose acknowledgements a step can still act on."""
    specs = [*a.moving.values(), *a.tracks.values()]
    handoffs = [*a.handoffs.values(), *a.track_handoffs.values()]
    return frozenset([m.move_id for m in specs] + [h.move_id for h in handoffs])


@dataclass(frozen=True, slots=True)
class ControlView:
    """What the control log says now: the newest assignment; the acknowledgements of the moves it refers
    to and of the `RECENT_MOVES` newest finished ones; the requests, each with the pids whose move has not
    started; the budgets set while running; `started`, the moves the assignment refers to and the newest
    finished ones.

    `released` keeps one `Released` per move: the committed one once it is in, else the announced one.
    A value: `apply` and `merge` return a new view; a log is folded in place by `Fold`."""

    assignment: AssignmentMsg | None = None
    released: Mapping[str, ReleasedMsg] = field(default_factory=dict)
    acquired: Mapping[str, AcquiredMsg] = field(default_factory=dict)
    track_done: Mapping[str, TrackDoneMsg] = field(default_factory=dict)  # by "move_id/side"
    requests: tuple[MoveRequestMsg, ...] = ()
    started: frozenset[str] = frozenset()
    budgets: Mapping[str, int] = field(default_factory=dict)
    """Each instance's state budget set while running (`BudgetMsg`), where one is set."""
    spill: bool | None = None
    """The newest `SpillGateMsg`'s word: whether instances spill at their threshold (None: never said,
    they do)."""

    def apply(self, msg: Message) -> ControlView:
        """The view after one more message (`Fold.add`)."""
        folded = Fold(self)
        folded.add(msg)
        return folded.view()

    def merge(self, other: ControlView) -> ControlView:
        """The view that knows what either knows (`Fold.merge`)."""
        folded = Fold(self)
        folded.merge(other)
        return folded.view()

    def pruned(self) -> ControlView:
        """Without the finished moves: all a step can need, and what a snapshot carries."""
        return Fold(self).view(finished=False)

    def track_ended(self, move_id: str, side: str) -> bool:
        return track_key(move_id, side) in self.track_done

    def pending_requests(self) -> list[tuple[MoveRequestMsg, int]]:
        """(request, pid) pairs no assignment has started yet, in request order."""
        return [(r, p) for r in self.requests for p in r.pids]


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotMsg:
    """The controller's view of the whole log so far, without its finished moves (`ControlView.pruned`).

    The controller writes one at its start and every `control.SNAPSHOT_EVERY` messages after
    (`ControlLog.write_snapshot`): a reader of a log whose first records are gone (deleted by hand, or by
    a retention someone set) takes the state from before them from the snapshot after them."""

    view: ControlView
    read_to: int
    """The writer had read every record below this offset: a record below the snapshot but not below
    this one (in a transaction still open then) is not in `view`, so its deletion loses it."""
    version: int = PROTOCOL_VERSION


Message = (
    AssignmentMsg
    | ReleasedMsg
    | AcquiredMsg
    | TrackDoneMsg
    | MoveRequestMsg
    | BudgetMsg
    | SpillGateMsg
    | SnapshotMsg
)


Ack = ReleasedMsg | AcquiredMsg | TrackDoneMsg

CONTROLLER = "controller"
"""The writer of assignments, snapshots, move requests, budgets and spill gates
(`pipeline.signing.CONTROLLER`)."""


def author_of(msg: Message) -> str:
    """The one writer that may publish `msg`: the instance an acknowledgement speaks for, else the
    controller (decision 0064)."""
    if isinstance(msg, ReleasedMsg | AcquiredMsg | TrackDoneMsg):
        return msg.instance
    return CONTROLLER


class Fold:
    """The control log folded in place: each message costs the same however long the log, and the state
    does not grow with it (an assignment costs its own size).

    - Assignments: the newest epoch wins; a different one with the same epoch is refused.
    - Acknowledgements are kept while the newest assignment refers to their move. An assignment that no
      longer refers to a move ends it (finished, or abandoned by a recovery): its acknowledgements go to
      the `RECENT_MOVES` window, and one arriving later (a zombie's, or a committed `Released` after its
      announcement served) is dropped: every acknowledgement follows, in the log, the assignment that
      refers to its move, as its writer read that assignment before writing it.
    - A request keeps the pids whose move no assignment has started.
    - A budget: the newest per instance; 0 drops it (the configured one applies again).
    - A spill gate: the newest.

    `complete` is False for a fold that began after the log's first records (deleted): the assignment
    an acknowledgement follows may be among them, so it keeps every acknowledgement until a snapshot
    brings the state from before; then it is complete. A complete fold skips snapshots: it holds what
    they say already.
    """

    def __init__(self, start: ControlView | None = None, *, complete: bool = True) -> None:
        self.complete = complete
        self.assignment: AssignmentMsg | None = None
        self._moves: frozenset[str] = frozenset()  # those of `assignment`
        self._released: dict[str, ReleasedMsg] = {}
        self._acquired: dict[str, AcquiredMsg] = {}
        self._track_done: dict[str, TrackDoneMsg] = {}
        self._requests: dict[str, MoveRequestMsg] = {}  # by request id, with the pids not started
        self._finished: dict[str, list[Ack]] = {}  # move id -> its acknowledgements, oldest move first
        self._budgets: dict[str, int] = {}
        self._spill: bool | None = None
        if start is not None:
            self.merge(start)

    def add(self, msg: Message) -> None:
        if isinstance(msg, AssignmentMsg):
            if self._newer(msg):
                self.assignment = msg
                if self.complete:
                    self._settle()
        elif isinstance(msg, SnapshotMsg):
            if not self.complete:
                self.merge(msg.view)
                self.complete = True
        elif isinstance(msg, MoveRequestMsg):
            self._request(msg)
        elif isinstance(msg, BudgetMsg):
            self._budget(msg.instance, msg.state_budget_bytes)
        elif isinstance(msg, SpillGateMsg):
            self._spill = msg.spill
        elif not self.complete or self.assignment is None or msg.move_id in self._moves:
            self._acknowledge(msg)

    def merge(self, view: ControlView) -> None:
        """Take in what `view` knows: its assignment if newer, its acknowledgements, its requests (a pid
        either has started is started), then drop what the newest assignment makes history."""
        if view.assignment is not None and self._newer(view.assignment):
            self.assignment = view.assignment
        acks: list[Ack] = [*view.released.values(), *view.acquired.values(), *view.track_done.values()]
        for ack in acks:
            self._acknowledge(ack)
        for request in view.requests:
            self._request(request)
        for instance, budget in view.budgets.items():  # a snapshot's are newer than what preceded it
            self._budget(instance, budget)
        if view.spill is not None:
            self._spill = view.spill
        ongoing = moves_of(self.assignment) if self.assignment is not None else frozenset()
        for move_id in view.started - ongoing:
            self._finished.setdefault(move_id, [])
        self._settle()

    def view(self, finished: bool = True) -> ControlView:
        released, acquired, track_done = dict(self._released), dict(self._acquired), dict(self._track_done)
        if finished:
            for acks in self._finished.values():
                for ack in acks:
                    if isinstance(ack, ReleasedMsg):
                        released[ack.move_id] = ack
                    elif isinstance(ack, AcquiredMsg):
                        acquired[ack.move_id] = ack
                    else:
                        track_done[ack.key] = ack
        return ControlView(
            assignment=self.assignment,
            released=released,
            acquired=acquired,
            track_done=track_done,
            requests=tuple(self._requests.values()),
            started=self._moves | self._finished.keys() if finished else self._moves,
            budgets=dict(self._budgets),
            spill=self._spill,
        )

    def _newer(self, msg: AssignmentMsg) -> bool:
        a = self.assignment
        if a is not None and msg.epoch == a.epoch and msg != a:
            raise ConflictingAssignments(f"two different assignments of epoch {msg.epoch} in the control log")
        return a is None or msg.epoch > a.epoch

    def _acknowledge(self, ack: Ack) -> None:
        if isinstance(ack, ReleasedMsg):
            known = self._released.get(ack.move_id)
            if not (ack.announced and known is not None and not known.announced):
                self._released[ack.move_id] = ack
        elif isinstance(ack, AcquiredMsg):
            self._acquired[ack.move_id] = ack
        else:
            self._track_done[ack.key] = ack

    def _request(self, msg: MoveRequestMsg) -> None:
        known = self._requests.get(msg.request_id, msg)
        pids = tuple(p for p in known.pids if p in msg.pids and not self._started(msg.move_id(p)))
        if pids:
            self._requests[msg.request_id] = replace(msg, pids=pids)
        else:
            self._requests.pop(msg.request_id, None)

    def _budget(self, instance: str, budget: int) -> None:
        if budget:
            self._budgets[instance] = budget
        else:
            self._budgets.pop(instance, None)

    def _started(self, move_id: str) -> bool:
        return move_id in self._moves or move_id in self._finished

    def _settle(self) -> None:
        """Bring the state in line with the newest assignment: end the moves it no longer refers to,
        forget the requests it starts."""
        if self.assignment is None:
            return
        moves = moves_of(self.assignment)
        for move_id in moves - self._moves:
            self._finished.pop(move_id, None)  # a move referred to again is not over
        acknowledged = {*self._released, *self._acquired, *(t.move_id for t in self._track_done.values())}
        for move_id in sorted((self._moves | acknowledged) - moves):
            self._finish(move_id)
        self._forget_oldest()
        self._moves = moves
        if self._requests and moves:
            for request in list(self._requests.values()):
                self._request(request)

    def _finish(self, move_id: str) -> None:
        acks: list[Ack] = []
        for found in (
            self._released.pop(move_id, None),
            self._acquired.pop(move_id, None),
            *(self._track_done.pop(track_key(move_id, side), None) for side in ("old", "new")),
        ):
            if found is not None:
                acks.append(found)
        self._finished.pop(move_id, None)
        self._finished[move_id] = acks  # the newest last

    def _forget_oldest(self) -> None:
        while len(self._finished) > RECENT_MOVES:
            del self._finished[next(iter(self._finished))]


def fold(messages: Iterable[Message], start: ControlView | None = None) -> ControlView:
    folded = Fold(start)
    for msg in messages:
        folded.add(msg)
    return folded.view()
