"""A policy's rounds over time: collect statistics for an interval, decide, carry out, repeat.

The policies are pure functions of a `Snapshot` (decision 0005); what they carry from round to round (the
collection interval, the time of the last adaptation, a move phase in progress) lives here, so that the
local controller (`controller.runner`) and the Kubernetes operator (`controller.k8s.reconciler`) run a
policy the same way. `tick` never blocks: a caller ticks it from its own loop, and a round whose moves
are still in flight (Flux's move phase) simply ends when they have completed.

A move phase ends when every moved pid has left its source: the assignment of record then gives it to
its new owner, and the snapshot charges its arrival rate there (`controller.observation.snapshot`).
Neither the new owner's first batch with the pid, which reads the backlog since the cutoff and can be
long when the source was behind, nor a parallel track's tail (the source finishing the pid's old
tuples) holds up the next round; the pid stays out of the policy's reach until its move is over
(`Snapshot.moves_in_flight`; docs/load-model.md, "Rounds and move phases"; "Arrival rates").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from controller.assignment import Move
from controller.policies import POLICIES, Decision, Policy, Snapshot

FIRST_ROUND_DELAY_S = 5.0
"""The first round waits at least this long, so that every instance has reported a few batches."""
MIN_INTERVAL_S = 0.25
"""Floor of the interval after a move phase for policies without their own minimum (Flux has delta_min)."""


class PolicyMover(Protocol):
    """What a policy round needs from whoever carries out moves."""

    def releasing(self) -> Sequence[Move]:
        """Moves whose pid its source has not released yet (a handoff on its way to the new owner, or a
        parallel track's tail, is not one)."""
        ...

    def request(self, moves: Sequence[Move]) -> None: ...

    def gate_spills(self, spill: bool) -> None:
        """Tell the instances whether to spill at their threshold (`Decision.spill`), if they were told
        otherwise."""
        ...

    def snapshot(self, interval_s: float, now_s: float, last_adaptation_s: float | None) -> Snapshot | None:
        """Statistics of the last `interval_s` seconds, or None while there is no assignment yet."""
        ...


@dataclass
class PolicyRounds:
    """One policy's round schedule and the state it carries between rounds (times on a monotonic clock)."""

    policy: Policy[Any]
    params: Any
    interval_s: float
    next_round_s: float
    last_adaptation_s: float | None = None
    move_phase_since_s: float | None = None
    """Set while the moves of a round whose next interval is "as long as the move phase" are in flight."""
    last_snapshot: Snapshot | None = None
    """What the latest round decided on."""

    @classmethod
    def begin(cls, name: str, params: Any, now_s: float | None = None) -> PolicyRounds:
        now = time.monotonic() if now_s is None else now_s
        interval = float(getattr(params, "delta_s", 2.0))
        return cls(POLICIES[name], params, interval, now + max(interval, FIRST_ROUND_DELAY_S))

    def tick(self, mover: PolicyMover, now_s: float | None = None, dry_run: bool = False) -> Decision | None:
        """Run the round that is due, if one is: its decision, whose moves were requested unless `dry_run`.

        None when no round ran (not due yet, a move phase still running, no assignment yet, an
        instance warming up).
        """
        now = time.monotonic() if now_s is None else now_s
        if self.move_phase_since_s is not None:
            if mover.releasing():
                return None
            self._next_in(max(now - self.move_phase_since_s, self._delta_min_s()), now)
            self.move_phase_since_s = None
            return None
        if now < self.next_round_s:
            return None
        snapshot = mover.snapshot(self.interval_s, now, self.last_adaptation_s)
        if snapshot is None:
            self._next_in(self.interval_s, now)
            return None
        if snapshot.warming:
            return None  # tried again at the next tick: the instance's load is measured within a batch
        self.last_snapshot = snapshot
        decision = self.policy.decide(snapshot, self.params)
        if decision.spill is not None and not dry_run:
            mover.gate_spills(decision.spill)
        interval = decision.next_interval_s
        if decision.moves and not dry_run:
            mover.request(decision.moves)
            self.last_adaptation_s = now
            if interval is None and getattr(self.params, "phase_interval", True):
                self.move_phase_since_s = now
                return decision
            # Without the paper's phase interval the next round does not wait for the releases: the
            # snapshot charges a moving pid to its new owner and leaves it out of the policy's reach,
            # and a loaded donor's release waits for its batch in flight (up to a minute, docs/load-model.md,
            # "Rounds and move phases").
            interval = interval or self._delta_min_s()
        self._next_in(interval or self.interval_s, now)
        return decision

    def _delta_min_s(self) -> float:
        """The shortest interval between rounds after one that moved pids."""
        return float(getattr(self.params, "delta_min_s", MIN_INTERVAL_S))

    def _next_in(self, interval_s: float, now_s: float) -> None:
        self.interval_s = interval_s
        self.next_round_s = now_s + interval_s
