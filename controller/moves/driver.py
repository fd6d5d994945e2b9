"""The control protocol's driver (`pipeline/protocol.py`) as a pure function: no Kafka, no clock, no
random ids (the caller mints them).

`plan_step` is the whole protocol driver: from the control view (newest assignment, acknowledgements,
requests), the live instances and the requested moves, it computes the next assignment to publish, or
None when nothing changes. It is level-triggered: the control log holds all the state, so a controller
killed in the middle of a move continues it after a restart, and running a step twice publishes nothing
new. `controller.moves.kafka_mover.KafkaPidMover` wraps it with the Kafka reads and writes.

Per move: (1) the pid goes in transit (no owner, `moving`), (2) once the source's `Released` is in the
log (a replay's as soon as the source has planned the batch that releases it) it goes to the target with
a `Handoff` (cutoff, snapshot), (3) once the target's `Acquired` is in the
log the handoff is dropped. A `parallel_track` move also lists the pid in `tracks` from step (2) until
the source's `TrackDone` (its old tuples expired); no other move of the pid starts meanwhile. Dead
instances (no heartbeat for the timeout) lose their pids to live ones by `replay` from their last
committed offsets, and are listed as evicted until they return empty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from controller.observation.liveness import Liveness
from pipeline.control_view import ControlView
from pipeline.protocol import (
    MODE_RULES,
    AcquiredMsg,
    AssignmentMsg,
    Handoff,
    Mode,
    MoveSpec,
    ReleasedMsg,
    TrackDoneMsg,
    track_key,
)

Markers = Mapping[str, Mapping[int, Mapping[str, int]]]
"""Each instance's newest commit marker: pid -> stream -> the end offset of its newest committed batch."""
SpillPoints = Mapping[str, Mapping[int, tuple[Mapping[str, int], ...]]]
"""Each instance's newest commit marker: pid -> where each of its spilled generations began."""


@dataclass
class _Draft:
    """The next assignment while a step builds it, and what the step says of it."""

    owners: dict[int, str]
    moving: dict[int, MoveSpec]
    handoffs: dict[int, Handoff]
    tracks: dict[int, MoveSpec]
    track_handoffs: dict[int, Handoff]
    evicted: list[str]
    said: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, a: AssignmentMsg) -> _Draft:
        return cls(
            dict(a.owners),
            dict(a.moving),
            dict(a.handoffs),
            dict(a.tracks),
            dict(a.track_handoffs),
            list(a.evicted),
        )

    def published_after(self, a: AssignmentMsg) -> tuple[AssignmentMsg | None, list[str]]:
        """The next epoch, or None when the draft is `a` unchanged."""
        unchanged = _Draft.of(a)
        unchanged.said = self.said
        if self == unchanged:
            return None, self.said
        return AssignmentMsg(
            epoch=a.epoch + 1,
            owners=self.owners,
            moving=self.moving,
            handoffs=self.handoffs,
            tracks=self.tracks,
            track_handoffs=self.track_handoffs,
            evicted=tuple(self.evicted),
        ), self.said


def plan_step(
    view: ControlView,
    liveness: Liveness,
    requested: Sequence[MoveSpec],
    markers: Markers,
    earliest: Callable[[int], Mapping[str, int]],
    new_id: Callable[[], str],
    spilled: SpillPoints | None = None,
) -> tuple[AssignmentMsg | None, list[str]]:
    """The next assignment (None: nothing to publish) and what happened, as lines for the log.

    `markers` are the instances' newest commit markers (read once the dead ones are fenced), and
    `spilled` the spill points they hold (`CommitMarker.spilled`), per instance and pid;
    `earliest(pid)` the log start offsets, for the pids of a dead instance that never committed anything;
    `new_id()` a move id never used before, for each handoff that recovers a dead instance's pid.

    In four stages, each reading what the one before drafted: the acknowledgements the log holds
    (`_acknowledged`), instances back after an eviction (`_rejoined_members`), the pids of the dead
    (`_recover`), and the requested moves (`_start_requested`).
    """
    a = view.assignment
    if a is None:
        return None, []
    draft = _Draft.of(a)
    _acknowledged(draft, view)
    _rejoined_members(draft, liveness, a.epoch)
    # The dead not yet evicted, with pids or without (on return it must start empty either way), and the
    # evicted that still hold pids: whether they still run, rejoined empty or died, nobody reads those.
    dead = to_recover(a, liveness)
    members = {i for i in liveness.live if not _is_evicted(i, draft.evicted)}
    if dead:
        survivors = sorted(members - set(dead))
        if not survivors:
            return draft.published_after(a)
        _recover(draft, view, liveness, dead, survivors, markers, earliest, new_id, spilled or {})
    _start_requested(draft, view, requested, members, dead)
    return draft.published_after(a)


def _acknowledged(d: _Draft, view: ControlView) -> None:
    """Each step an acknowledgement in the log ends. An acknowledgement counts only from the instance
    the step waits for: a late one from an instance declared dead (its transaction committed before it
    was fenced) must not end its successor's step."""
    for p, h in list(d.handoffs.items()):
        if _from(view.acquired.get(h.move_id), d.owners.get(p)):
            del d.handoffs[p]
            d.said.append(f"move {h.move_id}: pid {p} now processed by {d.owners.get(p)}")
    for p, h in list(d.track_handoffs.items()):
        if _from(view.acquired.get(h.move_id), d.tracks[p].source if p in d.tracks else None):
            del d.track_handoffs[p]
    for p, m in list(d.moving.items()):
        released = view.released.get(m.move_id)
        if _from(released, m.source):
            assert released is not None
            del d.moving[p]
            d.owners[p] = m.target
            d.handoffs[p] = Handoff(
                move_id=m.move_id,
                mode=m.mode,
                cutoff=released.cutoff,
                snapshot=released.snapshot,
                stream_max=released.stream_max,
            )
            if MODE_RULES[m.mode].sender_keeps_window:  # the sender reads on: an overlap
                d.tracks[p] = m
                d.said.append(f"move {m.move_id}: pid {p} runs on {m.source} (old tuples) and {m.target}")
            else:
                d.said.append(f"move {m.move_id}: pid {p} released by {m.source}, handed to {m.target}")
    for p, m in list(d.tracks.items()):
        # the old side's end counts once: the track's source is "" from then on
        old_done = not m.source or _from(view.track_done.get(track_key(m.move_id, "old")), m.source)
        new_done = _from(view.track_done.get(track_key(m.move_id, "new")), m.target)
        if old_done and new_done:
            del d.tracks[p]
            d.track_handoffs.pop(p, None)
            d.said.append(f"move {m.move_id}: pid {p}'s parallel track is over")
        elif old_done and m.source:
            d.tracks[p] = replace(m, source="")
            d.track_handoffs.pop(p, None)
            d.said.append(f"move {m.move_id}: pid {p}'s old tuples expired on {m.source}, which lets it go")


def _rejoined_members(d: _Draft, liveness: Liveness, epoch: int) -> None:
    """Instances that return after eviction (a new incarnation) are members again, with no pids, once
    their evicted incarnation holds nothing (until then, its pids are recovered)."""
    held = holders(d.owners, d.moving, d.tracks)
    for entry in list(d.evicted):
        name = entry.partition("@")[0]
        if _rejoined(entry, liveness, epoch) and name not in held:
            d.evicted.remove(entry)
            d.said.append(f"{name} rejoined as a new, empty instance")


def _recover(
    d: _Draft,
    view: ControlView,
    liveness: Liveness,
    dead: list[str],
    survivors: list[str],
    markers: Markers,
    earliest: Callable[[int], Mapping[str, int]],
    new_id: Callable[[], str],
    spilled: SpillPoints,
) -> None:
    """The pids, moves and overlap sides of `dead` go to `survivors` by replay; the dead are evicted.
    A pid the dead instance had spilled is replayed from its spill point (`Handoff.spilled`)."""
    owners, moving, handoffs, tracks, said = d.owners, d.moving, d.handoffs, d.tracks, d.said
    load = {i: sum(1 for o in owners.values() if o == i) for i in survivors}

    def least_loaded(avoid: str = "") -> str:
        target = min(survivors, key=lambda i: (i == avoid, load[i], i))
        load[target] += 1
        return target

    for dying in dead:
        # An overlap's two sides need two instances: a side recovers on any survivor but the other.
        others = {m.target for m in tracks.values() if m.source == dying}
        others |= {m.source for p, m in tracks.items() if owners.get(p) == dying and m.source}
        if any(all(i == o for i in survivors) for o in others):
            said.append(f"{dying} is dead: waiting for it or another instance (a parallel track needs two)")
            continue
        for p, m in list(moving.items()):
            if m.target != dying:
                continue
            if any(i != m.source for i in survivors):  # the source may release at any moment
                moving[p] = replace(m, target=least_loaded(m.source))
            else:  # its release may be committed unseen: the pid returns to it by a handoff
                said.append(f"move {m.move_id}: target {dying} is dead, no other instance: waiting")
        lost = sorted(p for p, o in owners.items() if o == dying)
        lost += sorted(p for p, m in moving.items() if m.source == dying)
        for p in lost:
            track = tracks.get(p)
            resumed = track is not None and not view.track_ended(track.move_id, "new")
            handoff = handoffs.get(p)
            cutoff = markers.get(dying, {}).get(p)
            if handoff is None and not resumed and cutoff is None:
                if dying in markers:
                    said.append(
                        f"{dying} is dead: waiting for its committed offsets of pid {p} (its newest commit "
                        "marker lacks the pid, and the log start would repeat every result)"
                    )
                    continue
                cutoff = earliest(p)  # it never committed anything, so nothing of the pid either
            move = moving.pop(p, None)
            # Never onto the overlap's old side, even once the new side's part is over: one
            # instance holds one window per pid.
            target = least_loaded(track.source if track else "")
            if track is not None:
                tracks[p] = replace(track, target=target)
            if resumed:
                if handoff is None and track is not None:  # the overlap's new side: its tuples
                    handoffs[p] = _resume(view, track, cutoff, new_id())  # since the cutoff, re-read
            elif cutoff is not None:  # what it committed (a handoff it took, unseen, included)
                spill = spilled.get(dying, {}).get(p)
                handoffs[p] = Handoff(move_id=new_id(), mode=Mode.REPLAY, cutoff=cutoff, spilled=spill)
            elif handoff is not None:  # a handoff never taken: the new owner starts where it said,
                # under an id of its own, which a late acknowledgement of the dead one cannot end
                handoffs[p] = replace(handoff, move_id=new_id())
            owners[p] = target
            why = f" (its move {move.move_id} is abandoned)" if move else ""
            said.append(f"{dying} is dead: pid {p} recovered on {target} by replay{why}")
        for p, m in sorted(tracks.items()):
            if m.source == dying:  # the overlap's old side: its window rebuilt, then re-read since the cutoff
                holder = least_loaded(m.target)
                if p not in d.track_handoffs:
                    d.track_handoffs[p] = _resume(view, m, markers.get(dying, {}).get(p), new_id())
                tracks[p] = replace(m, source=holder)
                said.append(f"{dying} is dead: pid {p}'s old tuples recovered on {holder} by replay")
        if not _is_evicted(dying, d.evicted):
            d.evicted.append(f"{dying}@{liveness.incarnations.get(dying, '?')}")


def _start_requested(
    d: _Draft, view: ControlView, requested: Sequence[MoveSpec], members: set[str], dead: list[str]
) -> None:
    """Each requested move of a pid that rests with its source, to a live member, starts."""
    for m in requested:
        p = m.pid
        busy = p in d.moving or p in d.handoffs or p in d.tracks
        if d.owners.get(p) != m.source or m.source == m.target or busy or m.move_id in view.started:
            continue
        if m.target not in members or m.target in dead:
            d.said.append(f"move of pid {p} to {m.target} refused: {m.target} is not live")
            continue
        del d.owners[p]
        d.moving[p] = m
        d.said.append(f"move {m.move_id}: pid {p} {m.source} -> {m.target} ({m.mode.value}) started")


def to_recover(a: AssignmentMsg, liveness: Liveness) -> list[str]:
    """The instances whose pids a step recovers: the dead not yet evicted, and the evicted (under any
    incarnation, dead or alive) that the assignment still gives pids, moves or a side of an overlap."""
    listed = {e.partition("@")[0] for e in a.evicted}
    held = holders(a.owners, a.moving, a.tracks)
    return sorted({i for i in liveness.dead if i not in listed} | (listed & held))


def _rejoined(entry: str, liveness: Liveness, epoch: int) -> bool:
    """Whether the instance evicted as `entry` ("name@incarnation") runs again under a new incarnation.
    "name@?" (evicted unheard) names no incarnation: the one heard must have read an assignment that
    lists the eviction (`epoch`, the newest, does), since one that ran before it stops on reading it
    without another heartbeat, and one that starts after it begins empty."""
    name, _, incarnation = entry.partition("@")
    heard = liveness.live.get(name)
    if heard is None or heard == incarnation:
        return False
    return incarnation != "?" or liveness.epochs.get(name, -1) >= epoch


def holders(
    owners: Mapping[int, str], moving: Mapping[int, MoveSpec], tracks: Mapping[int, MoveSpec]
) -> set[str]:
    """Every instance the assignment gives a pid, a move (either end) or a side of an overlap."""
    ends = {i for m in [*moving.values(), *tracks.values()] for i in (m.source, m.target)}
    return (set(owners.values()) | ends) - {""}


def _from(ack: ReleasedMsg | AcquiredMsg | TrackDoneMsg | None, expected: str | None) -> bool:
    return ack is not None and ack.instance == expected


def _resume(view: ControlView, track: MoveSpec, committed: Mapping[str, int] | None, move_id: str) -> Handoff:
    """Where a side of a parallel track whose instance died resumes (under `move_id`): at its newest
    committed offsets, after re-reading silently from the overlap's cutoff (both known from the sender's
    `Released`)."""
    released = view.released[track.move_id]
    return Handoff(
        move_id=move_id,
        mode=Mode.PARALLEL_TRACK,
        cutoff=committed or released.cutoff,
        stream_max=released.stream_max,
        since=released.cutoff,
    )


def _is_evicted(instance: str, evicted: list[str]) -> bool:
    return any(e.partition("@")[0] == instance for e in evicted)
