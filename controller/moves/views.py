"""What a control view says of moves: those releasing, cutting over or in flight, those finished
between two views, the moves `fluxjoin move` asked for, and a request's outcome.

Read-only functions of a `ControlView`, apart from the driver (`controller.moves.driver`) that plans
the next assignment: the Kafka mover, `fluxjoin move` and the tests read moves through them.
"""

from __future__ import annotations

from collections.abc import Sequence

from controller.assignment import FinishedMove, Move
from pipeline.control_view import ControlView
from pipeline.protocol import MoveRequestMsg, MoveSpec


def requested_moves(view: ControlView, now_ms: float) -> tuple[list[MoveSpec], list[str]]:
    """The moves `fluxjoin move` asked for that no assignment has started, from their pids' owners now;
    a request past its expiry (its caller stopped waiting) is dropped with a line saying so."""
    owners = view.assignment.owners if view.assignment else {}
    moves: list[MoveSpec] = []
    said: list[str] = []
    for request, pid in view.pending_requests():
        if request.expires_ms is not None and request.expires_ms < now_ms:
            said.append(f"move request {request.request_id} of pid {pid} expired unserved: dropped")
            continue
        source = owners.get(pid)
        if source is not None and source != request.target:
            moves.append(
                MoveSpec(
                    move_id=request.move_id(pid),
                    pid=pid,
                    source=source,
                    target=request.target,
                    mode=request.mode,
                )
            )
    return moves, said


def moves_releasing(view: ControlView) -> list[Move]:
    """Moves whose pid its source has not released yet: until then the pid is the source's in the
    assignment of record; from then on its new owner's, though the owner may not have read it yet."""
    a = view.assignment
    if a is None:
        return []
    # a move of an instance to itself (written by an older controller) is none: the pid stays put
    return [Move(p, m.source, m.target, m.mode) for p, m in a.moving.items() if m.source != m.target]


def moves_cutting_over(view: ControlView) -> list[Move]:
    """Moves whose pid has not reached its new owner yet: being released, or handed off and not yet
    acquired. A handoff's source is the instance that released the pid, or "?" for the recovery of a
    dead instance (nothing was released)."""
    a = view.assignment
    if a is None:
        return []
    moves = moves_releasing(view)
    for p, h in a.handoffs.items():
        if p in a.owners:
            released = view.released.get(h.move_id)
            source = released.instance if released and released.instance != a.owners[p] else "?"
            moves.append(Move(p, source, a.owners[p], h.mode))
    return moves


def moves_in_flight(view: ControlView) -> list[Move]:
    """`moves_cutting_over` and the parallel tracks whose source still holds the pid's old tuples."""
    moves = moves_cutting_over(view)
    if view.assignment is None:
        return moves
    listed = {m.pid for m in moves}
    tracks = view.assignment.tracks.items()
    return moves + [
        Move(p, m.source, m.target, m.mode) for p, m in tracks if p not in listed and m.source != m.target
    ]


def finished_moves(before: Sequence[Move], after: ControlView) -> list[FinishedMove]:
    """The moves of `before` (in flight under an earlier view) that `after` no longer has in flight."""
    if after.assignment is None:
        return []
    a, still = after.assignment, {(m.pid, m.source, m.target) for m in moves_in_flight(after)}
    return [
        FinishedMove(m, a.epoch, a.owners.get(m.pid))
        for m in before
        if (m.pid, m.source, m.target) not in still
    ]


def request_outcome(view: ControlView, request: MoveRequestMsg) -> dict[int, str] | None:
    """Each requested pid's owner of record once all the request's moves are over, None before: the
    target, or another instance when the target died during the move and the pid was recovered."""
    a = view.assignment
    if a is None:
        return None
    cutting_over = a.moving.keys() | a.handoffs.keys()
    if any(request.move_id(p) not in view.started or p in cutting_over for p in request.pids):
        return None
    return {p: a.owners[p] for p in request.pids}
