"""The control protocol: versioned messages on `<pipeline>.control` (one partition, one ordered log).

Shared wire contract between the controller (which writes `AssignmentMsg`) and the instances (which write
`ReleasedMsg` / `AcquiredMsg` inside the Kafka transaction of the micro-batch that did the work, so an
acknowledgement is visible exactly when the batch's output is). Pure: value objects, no I/O; their JSON
codecs are in `pipeline.protocol_codec`, the fold that turns the log into the current view (and the
snapshot message that carries it) in `pipeline.control_view`.

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

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

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


@dataclass(frozen=True, slots=True)
class ModeRules:
    """What a handoff mode does with a moved pid's window: the one place where the modes differ. The
    protocol's steps (in transit, handed off, acquired; an overlap in between for a kept window) are
    the same for every mode; the sender's batch plan (`pipeline.epoch_change`), its sink
    (`pipeline.batch_output`) and the controller (`controller.moves.driver`) read these rules."""

    sender_exports_window: bool
    """The sender's batch reads up to the cutoff and writes the window to the handoff topic."""
    released_at_plan: bool
    """The cutoff is where the sender's batch begins, so `Released` goes out as soon as it is planned."""
    receiver_rebuilds_from_log: bool
    """The receiver re-reads the input before the cutoff to rebuild the window."""
    sender_keeps_window: bool
    """The sender keeps the pid's old tuples and emits their results until they expire (an overlap);
    the receiver starts empty at the cutoff and emits only results of new tuples."""


MODE_RULES: Mapping[Mode, ModeRules] = {
    Mode.TRANSFER: ModeRules(
        sender_exports_window=True,
        released_at_plan=False,
        receiver_rebuilds_from_log=False,
        sender_keeps_window=False,
    ),
    Mode.REPLAY: ModeRules(
        sender_exports_window=False,
        released_at_plan=True,
        receiver_rebuilds_from_log=True,
        sender_keeps_window=False,
    ),
    Mode.PARALLEL_TRACK: ModeRules(
        sender_exports_window=False,
        released_at_plan=False,
        receiver_rebuilds_from_log=False,
        sender_keeps_window=True,
    ),
}


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
    # replay recovery of a pid whose old generations the dead instance had spilled (`pipeline.spill`):
    # the window is rebuilt at the first spill point, and each later generation up to the cutoff re-read
    # joined with the ones before it only, which makes the results spanning the generations that the
    # dead instance never made.
    spilled: tuple[Mapping[str, int], ...] | None = None


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
class SpillGateMsg:
    """Whether instances spill at their spill threshold (`spill`), or only once their windows pass the
    whole budget: Liu and Rundensteiner's coupling of spilling with the distributed adaptation, which
    spills locally only when no instance has room (the `memory` policy with `spill_room`, decision
    0068). Until one is published, instances spill at their threshold."""

    spill: bool
    version: int = PROTOCOL_VERSION


class ProtocolError(ValueError):
    """A control message that cannot be decoded (unknown kind, newer version, missing field)."""


class ConflictingAssignments(ProtocolError):
    """Two different assignments with one epoch: two controllers published, or one published a second
    time from a view without its first. Readers would split over which to follow, so none follows either."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CommitMarker:
    """The record every batch's transaction ends with on `<pipeline>.sink-commits`: which batch of which
    incarnation committed, under which epoch, and where its input reached. An instance's newest marker
    is where a restart skips already committed output and where the controller recovers a dead
    instance's pids from (their replay cutoffs)."""

    instance: str
    incarnation: str
    batch: int
    epoch: int
    offsets: Mapping[str, Mapping[int, int]]  # stream -> pid -> next offset to read
    time_ms: int
    # pid -> where each of its later generations began, for each pid whose old generations are out of
    # memory (`pipeline.spill`): a recovery re-reads the generations from there and makes what spans them.
    spilled: Mapping[int, tuple[Mapping[str, int], ...]] = field(default_factory=dict)

    def pids(self) -> frozenset[int]:
        """The pids the batch held (every stream lists the same)."""
        return frozenset(next(iter(self.offsets.values()), {}))

    def cutoffs(self) -> dict[int, dict[str, int]]:
        """Per pid, where each stream's input reached: a recovery's replay cutoff."""
        return {p: {s: by_pid[p] for s, by_pid in self.offsets.items()} for p in self.pids()}
