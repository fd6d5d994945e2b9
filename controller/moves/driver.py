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
from dataclasses import replace

from controller.observation.liveness import Liveness
from pipeline.control_view import ControlView
from pipeline.protocol import (
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


def plan_step(
    view: ControlView,
    liveness: Liveness,
    requested: Sequence[MoveSpec],
    markers: Markers,
    earliest: Callable[[int], Mapping[str, int]],
    new_id: Callable[[], str],
) -> tuple[AssignmentMsg | None, list[str]]:
    """The next assignment (None: nothing to publish) and what happened, as lines for the log.

    `markers` are the instances' newest commit markers (read once the dead ones are fenced);
    `earliest(pid)` the log start offsets, for the pids of a dead instance that never committed anything;
    `new_id()` a move id never used before, for each handoff that recovers a dead instance's pid.
    """
    a = view.assignment
    if a is None:
        return None, []
    owners = dict(a.owners)
    moving = dict(a.moving)
    handoffs = dict(a.handoffs)
    tracks = dict(a.tracks)
    track_handoffs = dict(a.track_handoffs)
    evicted = list(a.evicted)
    said: list[str] = []

    # An acknowledgement counts only from the instance the step waits for: a late one from an instance
    # declared dead (its transaction committed before it was fenced) must not end its successor's step.
    for p, h in list(handoffs.items()):
        if _from(view.acquired.get(h.move_id), owners.get(p)):
            del handoffs[p]
            said.append(f"move {h.move_id}: pid {p} now processed by {owners.get(p)}")
    for p, h in list(track_handoffs.items()):
        if _from(view.acquired.get(h.move_id), tracks[p].source if p in tracks else None):
            del track_handoffs[p]
    for p, m in list(moving.items()):
        released = view.released.get(m.move_id)
        if _from(released, m.source):
            assert released is not None
            del moving[p]
            owners[p] = m.target
            handoffs[p] = Handoff(
                move_id=m.move_id,
                mode=m.mode,
                cutoff=released.cutoff,
                snapshot=released.snapshot,
                stream_max=released.stream_max,
            )
            if m.mode is Mode.PARALLEL_TRACK:
                tracks[p] = m
                said.append(f"move {m.move_id}: pid {p} runs on {m.source} (old tuples) and {m.target}")
            else:
                said.append(f"move {m.move_id}: pid {p} released by {m.source}, handed to {m.target}")
    for p, m in list(tracks.items()):
        # the old side's end counts once: the track's source is "" from then on
        old_done = not m.source or _from(view.track_done.get(track_key(m.move_id, "old")), m.source)
        new_done = _from(view.track_done.get(track_key(m.move_id, "new")), m.target)
        if old_done and new_done:
            del tracks[p]
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s parallel track is over")
        elif old_done and m.source:
            tracks[p] = replace(m, source="")
            track_handoffs.pop(p, None)
            said.append(f"move {m.move_id}: pid {p}'s old tuples expired on {m.source}, which lets it go")

    # Instances that return after eviction (a new incarnation) are members again, with no pids, once
    # their evicted incarnation holds nothing (until then, its pids are recovered below).
    held = holders(owners, moving, tracks)
    for entry in list(evicted):
        name = entry.partition("@")[0]
        if _rejoined(entry, liveness, a.epoch) and name not in held:
            evicted.remove(entry)
            said.append(f"{name} rejoined as a new, empty instance")

    # The dead not yet evicted, with pids or without (on return it must start empty either way), and the
    # evicted that still hold pids: whether they still run, rejoined empty or died, nobody reads those.
    dead = to_recover(a, liveness)
    members = {i for i in liveness.live if not _is_evicted(i, evicted)}
    if dead:
        survivors = sorted(members - set(dead))
        if not survivors:
            return _publish(a, owners, moving, handoffs, tracks, track_handoffs, evicted, said)
        load = {i: sum(1 for o in owners.values() if o == i) for i in survivors}

        def least_loaded(avoid: str = "") -> str:
            target = min(survivors, key=lambda i: (i == avoid, load[i], i))
            load[target] += 1
            return target

        for d in dead:
            # An overlap's two sides need two instances: a side recovers on any survivor but the other.
            others = {m.target for m in tracks.values() if m.source == d}
            others |= {m.source for p, m in tracks.items() if owners.get(p) == d and m.source}
            if any(all(i == o for i in survivors) for o in others):
                said.append(f"{d} is dead: waiting for it or another instance (a parallel track needs two)")
                continue
            for p, m in list(moving.items()):
                if m.target != d:
                    continue
                if any(i != m.source for i in survivors):  # the source may release at any moment
                    moving[p] = replace(m, target=least_loaded(m.source))
                else:  # its release may be committed unseen: the pid returns to it by a handoff
                    said.append(f"move {m.move_id}: target {d} is dead, no other instance: waiting")
            lost = sorted(p for p, o in owners.items() if o == d)
            lost += sorted(p for p, m in moving.items() if m.source == d)
            for p in lost:
                track = tracks.get(p)
                resumed = track is not None and not view.track_ended(track.move_id, "new")
                handoff = handoffs.get(p)
                cutoff = markers.get(d, {}).get(p)
                if handoff is None and not resumed and cutoff is None:
                    if d in markers:
                        said.append(
                            f"{d} is dead: waiting for its committed offsets of pid {p} (its newest commit "
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
                    handoffs[p] = Handoff(move_id=new_id(), mode=Mode.REPLAY, cutoff=cutoff)
                elif handoff is not None:  # a handoff never taken: the new owner starts where it said,
                    # under an id of its own, which a late acknowledgement of the dead one cannot end
                    handoffs[p] = replace(handoff, move_id=new_id())
                owners[p] = target
                why = f" (its move {move.move_id} is abandoned)" if move else ""
                said.append(f"{d} is dead: pid {p} recovered on {target} by replay{why}")
            for p, m in sorted(tracks.items()):
                if m.source == d:  # the overlap's old side: its window rebuilt, then re-read since the cutoff
                    holder = least_loaded(m.target)
                    if p not in track_handoffs:
                        track_handoffs[p] = _resume(view, m, markers.get(d, {}).get(p), new_id())
                    tracks[p] = replace(m, source=holder)
                    said.append(f"{d} is dead: pid {p}'s old tuples recovered on {holder} by replay")
            if not _is_evicted(d, evicted):
                evicted.append(f"{d}@{liveness.incarnations.get(d, '?')}")

    for m in requested:
        p = m.pid
        busy = p in moving or p in handoffs or p in tracks
        if owners.get(p) != m.source or m.source == m.target or busy or m.move_id in view.started:
            continue
        if m.target not in members or m.target in dead:
            said.append(f"move of pid {p} to {m.target} refused: {m.target} is not live")
            continue
        del owners[p]
        moving[p] = m
        said.append(f"move {m.move_id}: pid {p} {m.source} -> {m.target} ({m.mode.value}) started")
    return _publish(a, owners, moving, handoffs, tracks, track_handoffs, evicted, said)


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


def _publish(
    a: AssignmentMsg,
    owners: dict[int, str],
    moving: dict[int, MoveSpec],
    handoffs: dict[int, Handoff],
    tracks: dict[int, MoveSpec],
    track_handoffs: dict[int, Handoff],
    evicted: list[str],
    said: list[str],
) -> tuple[AssignmentMsg | None, list[str]]:
    same = (
        owners == dict(a.owners)
        and moving == dict(a.moving)
        and handoffs == dict(a.handoffs)
        and tracks == dict(a.tracks)
        and track_handoffs == dict(a.track_handoffs)
        and tuple(evicted) == a.evicted
    )
    if same:
        return None, said
    return AssignmentMsg(
        epoch=a.epoch + 1,
        owners=owners,
        moving=moving,
        handoffs=handoffs,
        tracks=tracks,
        track_handoffs=track_handoffs,
        evicted=tuple(evicted),
    ), said
