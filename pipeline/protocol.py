"""The control protocol: versioned messages on `<pipeline>.control` (one partition, one ordered log).

Shared wire contract between the controller (which writes `AssignmentMsg`) and the instances (which write
`ReleasedMsg` / `AcquiredMsg` inside the Kafka transaction of the micro-batch that did the work, so an
acknowledgement is visible exactly when the batch's output is). Pure: value objects, JSON codecs and the
fold that turns the log into the current view; no I/O.

A move of pid p from S to T takes two assignment epochs (an offset barrier, as in Flux):

1. epoch e+1 lists p as *in transit* (no owner) with the move. S, at its next batch boundary, stops reading
   p; the batch that does so exports p's window (mode `transfer`) and commits `Released(p, cutoff)`, the
   offsets up to which S processed p.
2. epoch e+2 gives p to T with a `Handoff` (cutoff offsets, snapshot reference, mode). T, at its next batch
   boundary, installs the window (from the snapshot, or by re-reading the input before the cutoff for
   `replay`) and continues at the cutoff; its batch commits `Acquired(p)`.

A `replay` needs nothing from S's batch but its cutoff, where that batch begins (S reads no more of p):
S announces `Released(p, cutoff)` when it plans the batch, and T starts while S's batch runs.

A `parallel_track` move (PTLB) replaces step 1's barrier by an overlap: S does not stop reading p; its
batch at the boundary marks its window old and commits `Released(p, cutoff, stream_max)` (announced
already when the batch is planned, if the window's `stream_max` at the cutoff is known then). Epoch
e+2 gives p to T (empty window, from the cutoff) and lists p in `tracks`: S keeps reading p and emits
the results with an old tuple until its old tuples have left the window, then commits
`TrackDone(p, old)`, and the epoch after lets S go (the track's source becomes ""); T commits
`TrackDone(p, new)` once no new tuple can join an old one; once both are in, the track is dropped.

Every message carries the complete map, not a diff (a reader needs only the newest assignment), and an
epoch; instances act on assignments only at batch boundaries and never read or emit a pid they do not own
in the epoch they act on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, TypeVar

PROTOCOL_VERSION = 1


class Mode(Enum):
    """How a moved pid's window reaches its new owner."""

    TRANSFER = "transfer"
    """The sender exports the window at the cutoff; the receiver installs it (Flux, MSLB)."""
    REPLAY = "replay"
    """The receiver rebuilds the window by re-reading the input before the cutoff; nothing is shipped."""
    PARALLEL_TRACK = "parallel_track"
    """The receiver starts empty at the cutoff; the sender keeps the pid until its old tuples expire
    (PTLB). Nothing is shipped and the pid never pauses."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """Where an exported window lies: messages of the handoff topic, and the SHA-256 of their bytes."""

    topic: str
    partition: int
    offsets: tuple[int, ...]
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Handoff:
    """What a receiver needs to take a pid over: where to continue, and how to get the window."""

    move_id: str
    mode: Mode
    cutoff: Mapping[str, int]  # stream -> first offset the receiver reads
    snapshot: Snapshot | None = None  # transfer only
    # parallel_track only: the sender's largest event time per stream at the cutoff (decision 0047)
    stream_max: tuple[int, ...] | None = None
    # parallel_track recovery: the overlap began at `since`; [since, cutoff) is re-read silently (processed
    # as the dead instance processed it, emitting nothing) before reading on from the cutoff.
    since: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveSpec:
    """A move as the controller announced it."""

    move_id: str
    pid: int
    source: str
    target: str
    mode: Mode


@dataclass(frozen=True, slots=True, kw_only=True)
class AssignmentMsg:
    """The complete assignment of one epoch. A pid absent from `owners` is in transit (being released)."""

    epoch: int
    owners: Mapping[int, str]
    moving: Mapping[int, MoveSpec] = field(default_factory=dict)  # pid -> move, for pids in transit
    handoffs: Mapping[int, Handoff] = field(default_factory=dict)  # pid -> handoff, for pids being taken
    # pid -> its parallel_track move while the move's source still holds the old tuples (the overlap)
    tracks: Mapping[int, MoveSpec] = field(default_factory=dict)
    # pid -> where a new holder of the old tuples resumes (the previous holder died in the overlap)
    track_handoffs: Mapping[int, Handoff] = field(default_factory=dict)
    evicted: tuple[str, ...] = ()  # "instance@incarnation" declared dead; on return they restart empty
    version: int = PROTOCOL_VERSION

    def pids_of(self, instance: str) -> frozenset[int]:
        return frozenset(p for p, owner in self.owners.items() if owner == instance)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleasedMsg:
    """An instance stopped processing `pid`: everything before `cutoff` is in committed output.

    `announced`: published when the batch that releases the pid was planned, outside its transaction
    (a replay, or a parallel track whose `stream_max` is known then). The cutoff is where that batch
    begins, so everything before it is in committed output already."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    cutoff: Mapping[str, int]
    snapshot: Snapshot | None = None
    stream_max: tuple[int, ...] | None = None  # parallel_track: the receiver's lateness rule goes on from it
    announced: bool = False
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackDoneMsg:
    """One side of a parallel_track overlap is over: the sender (`side` "old") holds no old tuple of
    `pid` any more and can let it go; the receiver ("new") is back to the plain lateness rule."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    side: str
    version: int = PROTOCOL_VERSION

    @property
    def key(self) -> str:
        return track_key(self.move_id, self.side)


def eviction_entries(instance: str, incarnation: str | None) -> frozenset[str]:
    """The `evicted` entries that mean this incarnation of `instance`: its own, and "name@?", which a
    controller that never heard the instance writes (it had not started, or died unseen)."""
    return frozenset({f"{instance}@{incarnation}", f"{instance}@?"})


def track_key(move_id: str, side: str) -> str:
    """How `ControlView.track_done` names one side's end of one parallel track."""
    return f"{move_id}/{side}"


@dataclass(frozen=True, slots=True, kw_only=True)
class AcquiredMsg:
    """An instance installed `pid`'s window and committed its first batch as the owner."""

    instance: str
    epoch: int
    pid: int
    move_id: str
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveRequestMsg:
    """A request for moves (`fluxjoin move`); only the controller turns requests into assignments."""

    request_id: str
    pids: tuple[int, ...]
    target: str
    mode: Mode
    # wall-clock ms after which the requester no longer waits: a controller that reads it later drops it
    expires_ms: int | None = None
    version: int = PROTOCOL_VERSION

    def move_id(self, pid: int) -> str:
        return f"{self.request_id}-{pid}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetMsg:
    """The memory an instance's windows may hold, set while it runs (`fluxjoin budget`): it replaces the
    instance's configured budget from its next batch on; 0 returns it to the configured one. In the
    control log so that it outlives restarts and reaches an instance wherever it runs."""

    instance: str
    state_budget_bytes: int
    version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if self.state_budget_bytes < 0:
            raise ValueError(f"{self.instance}: a budget must be >= 0 bytes, got {self.state_budget_bytes}")


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


Message = AssignmentMsg | ReleasedMsg | AcquiredMsg | TrackDoneMsg | MoveRequestMsg | BudgetMsg | SnapshotMsg


class ProtocolError(ValueError):
    """A control message that cannot be decoded (unknown kind, newer version, missing field)."""


class ConflictingAssignments(ProtocolError):
    """Two different assignments with one epoch: two controllers published, or one published a second
    time from a view without its first. Readers would split over which to follow, so none follows either."""


# --- JSON codec ---


def snapshot_to_json(s: Snapshot | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"topic": s.topic, "partition": s.partition, "offsets": list(s.offsets), "sha256": s.sha256}


def snapshot_from_json(d: dict[str, Any] | None) -> Snapshot | None:
    if d is None:
        return None
    return Snapshot(
        topic=d["topic"], partition=int(d["partition"]), offsets=tuple(d["offsets"]), sha256=d["sha256"]
    )


def _stream_max(v: list[int] | None) -> tuple[int, ...] | None:
    return tuple(int(t) for t in v) if v is not None else None


def handoff_to_json(h: Handoff) -> dict[str, Any]:
    return {
        "move_id": h.move_id,
        "mode": h.mode.value,
        "cutoff": dict(h.cutoff),
        "snapshot": snapshot_to_json(h.snapshot),
        "stream_max": list(h.stream_max) if h.stream_max is not None else None,
        "since": dict(h.since) if h.since is not None else None,
    }


def handoff_from_json(d: dict[str, Any]) -> Handoff:
    return Handoff(
        move_id=d["move_id"],
        mode=Mode(d["mode"]),
        cutoff={s: int(o) for s, o in d["cutoff"].items()},
        snapshot=snapshot_from_json(d.get("snapshot")),
        stream_max=_stream_max(d.get("stream_max")),
        since={s: int(o) for s, o in d["since"].items()} if d.get("since") is not None else None,
    )


def move_to_json(m: MoveSpec) -> dict[str, Any]:
    return {"move_id": m.move_id, "pid": m.pid, "source": m.source, "target": m.target, "mode": m.mode.value}


def move_from_json(d: dict[str, Any]) -> MoveSpec:
    return MoveSpec(
        move_id=d["move_id"], pid=int(d["pid"]), source=d["source"], target=d["target"], mode=Mode(d["mode"])
    )


def encode(msg: Message) -> bytes:
    return json.dumps(message_to_json(msg), sort_keys=True).encode()


def message_to_json(msg: Message) -> dict[str, Any]:
    body: dict[str, Any]
    if isinstance(msg, AssignmentMsg):
        body = {
            "kind": "assignment",
            "epoch": msg.epoch,
            "owners": {str(p): o for p, o in sorted(msg.owners.items())},
            "moving": {str(p): move_to_json(m) for p, m in sorted(msg.moving.items())},
            "handoffs": {str(p): handoff_to_json(h) for p, h in sorted(msg.handoffs.items())},
            "tracks": {str(p): move_to_json(m) for p, m in sorted(msg.tracks.items())},
            "track_handoffs": {str(p): handoff_to_json(h) for p, h in sorted(msg.track_handoffs.items())},
            "evicted": list(msg.evicted),
        }
    elif isinstance(msg, ReleasedMsg):
        body = {
            "kind": "released",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
            "cutoff": dict(msg.cutoff),
            "snapshot": snapshot_to_json(msg.snapshot),
            "stream_max": list(msg.stream_max) if msg.stream_max is not None else None,
            "announced": msg.announced,
        }
    elif isinstance(msg, TrackDoneMsg):
        body = {
            "kind": "track_done",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
            "side": msg.side,
        }
    elif isinstance(msg, MoveRequestMsg):
        body = {
            "kind": "move_request",
            "request_id": msg.request_id,
            "pids": list(msg.pids),
            "target": msg.target,
            "mode": msg.mode.value,
            "expires_ms": msg.expires_ms,
        }
    elif isinstance(msg, BudgetMsg):
        body = {"kind": "budget", "instance": msg.instance, "state_budget_bytes": msg.state_budget_bytes}
    elif isinstance(msg, SnapshotMsg):
        view = msg.view
        body = {
            "kind": "snapshot",
            "read_to": msg.read_to,
            "assignment": message_to_json(view.assignment) if view.assignment is not None else None,
            "released": [message_to_json(m) for _, m in sorted(view.released.items())],
            "acquired": [message_to_json(m) for _, m in sorted(view.acquired.items())],
            "track_done": [message_to_json(m) for _, m in sorted(view.track_done.items())],
            "requests": [message_to_json(m) for m in view.requests],
            "budgets": dict(sorted(view.budgets.items())),
        }
    else:
        body = {
            "kind": "acquired",
            "instance": msg.instance,
            "epoch": msg.epoch,
            "pid": msg.pid,
            "move_id": msg.move_id,
        }
    return {"version": msg.version, **body}


def decode(raw: bytes) -> Message:
    try:
        d = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"malformed control message: {exc!r}") from None
    return message_from_json(d)


def message_from_json(d: Any) -> Message:
    try:
        version = int(d["version"])
        if version > PROTOCOL_VERSION:
            raise ProtocolError(f"control message version {version} is newer than {PROTOCOL_VERSION}")
        kind = d["kind"]
        if kind == "assignment":
            return AssignmentMsg(
                epoch=int(d["epoch"]),
                owners={int(p): o for p, o in d["owners"].items()},
                moving={int(p): move_from_json(m) for p, m in d["moving"].items()},
                handoffs={int(p): handoff_from_json(h) for p, h in d["handoffs"].items()},
                tracks={int(p): move_from_json(m) for p, m in d.get("tracks", {}).items()},
                track_handoffs={int(p): handoff_from_json(h) for p, h in d.get("track_handoffs", {}).items()},
                evicted=tuple(d["evicted"]),
            )
        if kind == "released":
            return ReleasedMsg(
                instance=d["instance"],
                epoch=int(d["epoch"]),
                pid=int(d["pid"]),
                move_id=d["move_id"],
                cutoff={s: int(o) for s, o in d["cutoff"].items()},
                snapshot=snapshot_from_json(d.get("snapshot")),
                stream_max=_stream_max(d.get("stream_max")),
                announced=bool(d.get("announced", False)),
            )
        if kind == "track_done":
            return TrackDoneMsg(
                instance=d["instance"],
                epoch=int(d["epoch"]),
                pid=int(d["pid"]),
                move_id=d["move_id"],
                side=d["side"],
            )
        if kind == "acquired":
            return AcquiredMsg(
                instance=d["instance"], epoch=int(d["epoch"]), pid=int(d["pid"]), move_id=d["move_id"]
            )
        if kind == "move_request":
            return MoveRequestMsg(
                request_id=d["request_id"],
                pids=tuple(int(p) for p in d["pids"]),
                target=d["target"],
                mode=Mode(d["mode"]),
                expires_ms=int(d["expires_ms"]) if d.get("expires_ms") is not None else None,
            )
        if kind == "budget":
            return BudgetMsg(instance=d["instance"], state_budget_bytes=int(d["state_budget_bytes"]))
        if kind == "snapshot":
            assignment = _decoded(AssignmentMsg, d["assignment"]) if d["assignment"] is not None else None
            released = [_decoded(ReleasedMsg, m) for m in d["released"]]
            acquired = [_decoded(AcquiredMsg, m) for m in d["acquired"]]
            track_done = [_decoded(TrackDoneMsg, m) for m in d["track_done"]]
            return SnapshotMsg(
                view=ControlView(
                    assignment=assignment,
                    released={m.move_id: m for m in released},
                    acquired={m.move_id: m for m in acquired},
                    track_done={m.key: m for m in track_done},
                    requests=tuple(_decoded(MoveRequestMsg, m) for m in d["requests"]),
                    started=moves_of(assignment) if assignment is not None else frozenset(),
                    budgets={str(i): int(b) for i, b in d.get("budgets", {}).items()},
                ),
                read_to=int(d["read_to"]),
            )
        raise ProtocolError(f"unknown control message kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"malformed control message: {exc!r}") from None


M = TypeVar("M", bound="Message")


def _decoded(kind: type[M], d: Any) -> M:
    """A message a snapshot carries, which must be of `kind`."""
    msg = message_from_json(d)
    if not isinstance(msg, kind):
        raise ProtocolError(f"a snapshot holds a {type(msg).__name__} where a {kind.__name__} belongs")
    return msg


# --- the log folded into the current view ---

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


Ack = ReleasedMsg | AcquiredMsg | TrackDoneMsg


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
