"""Memory balancing after Liu & Rundensteiner's distributed adaptation (section 5 of their paper).

The rule: with M_j the state instance j holds, when M_min / M_max < theta_d, and at least a minimum time
span after the previous adaptation, move (M_max - M_min) / 2 of state from the fullest instance (the
sender) to the emptiest (the receiver), choosing the most productive partition groups (small P_s / P_o:
state size over results produced), so that the state that keeps producing results stays in memory.
Defaults are their "80%-difference" trigger (theta_d = 0.8) and "Every 45s" span, the setting of their
three-machine experiment.

Where the paper leaves room, this module chooses as follows:

- M_j is `InstanceStats.state_bytes` (what the instance reports, overhead included); a pid's size is
  `PidStats.state_bytes` (their P_s) and its productivity is results / state_bytes (their P_o / P_s), so
  "most productive first" sorts it descending, ties by pid. A pid with no results sorts last.
- "About half the difference" is a budget that is never overshot: walk the candidates in order and take
  each one that still fits, skipping those that would overshoot (a later, smaller one may fill the gap).
  Whole pids only, so the amount moved is at most the budget and may be less.
- The receiver's `memory_limit_bytes`, when known (> 0), caps the budget as well: balancing must not push
  the receiver into spilling (their lazy-disk rule spills only when no machine has room).
- Adaptations do not overlap (their first lazy-disk restriction): while any move is in flight the policy
  waits, because the state in transit is counted on neither side and M_j would mislead.
- Pids with no state are never moved: they would cost a handoff and balance nothing.
- The time of the last adaptation arrives in `Snapshot.last_adaptation_s` (None: never), on the same
  injected clock as `Snapshot.now_s`; the caller records it when it orders the moves.
- The next decision is due after the snapshot's own interval: the paper samples periodically and gives
  no interval of its own.
- Spilled pids (`PidStats.spilled_bytes`) never move: their old generations are out of memory, and a
  move would first bring them back on the sender to clean them up (docs/memory.md).
- Their lazy-disk rule, "spill locally only when no machine has room", is `spill_room` (0: off). An
  instance has room when it reports a budget and holds less than `spill_room` of it (set it to the
  instances' `spill_threshold`). Every round then says whether instances spill at their threshold
  (`Decision.spill`): only when none has room; otherwise only past their whole budget, while this
  policy moves state to the instance with room (decision 0068).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

from controller.assignment import HandoffMode, Move
from controller.policies.base import Decision, Snapshot, no_change


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryParams:
    """Trigger ratio, cooldown and handoff mode of the distributed adaptation."""

    theta_d: float = 0.8
    min_span_s: float = 45.0
    mode: HandoffMode = HandoffMode.TRANSFER
    spill_room: float = 0.0
    """Couple the instances' spilling with this policy when > 0: the share of its budget below which an
    instance has room."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.spill_room <= 1.0:
            raise ValueError(f"spill_room must be in [0, 1], got {self.spill_room}")
        if not 0.0 < self.theta_d <= 1.0:
            raise ValueError(f"theta_d must be in (0, 1], got {self.theta_d}")
        if self.min_span_s < 0.0:
            raise ValueError(f"min_span_s must be >= 0, got {self.min_span_s}")


class MemoryPolicy:
    """Move about half the state gap from the fullest to the emptiest instance, productive pids first."""

    name = "memory"

    def default_params(self) -> MemoryParams:
        return MemoryParams()

    def decide(self, snapshot: Snapshot, params: MemoryParams) -> Decision:
        """One distributed adaptation, or the reason there is none; with `spill_room`, whether instances
        spill at their threshold."""
        decision = self._adapt(snapshot, params)
        if params.spill_room <= 0:
            return decision
        roomy = [
            s.instance
            for s in snapshot.instances
            if s.memory_limit_bytes > 0 and s.state_bytes < params.spill_room * s.memory_limit_bytes
        ]
        if not roomy:
            return replace(decision, spill=True, reason=f"{decision.reason}; no instance has room: spill")
        reason = f"{decision.reason}; {', '.join(roomy)} ha{'s' if len(roomy) == 1 else 've'} room: no spill"
        return replace(decision, spill=False, reason=reason)

    def _adapt(self, snapshot: Snapshot, params: MemoryParams) -> Decision:
        interval = snapshot.interval_s
        if snapshot.moves_in_flight:
            return no_change(f"memory: {len(snapshot.moves_in_flight)} move(s) still in flight", interval)
        if len(snapshot.instances) < 2:
            return no_change("memory: fewer than two live instances", interval)
        sender = min(snapshot.instances, key=lambda s: (-s.state_bytes, s.instance))
        receiver = min(snapshot.instances, key=lambda s: (s.state_bytes, s.instance))
        m_max, m_min = sender.state_bytes, receiver.state_bytes
        if m_max == 0:
            return no_change("memory: no instance holds state", interval)
        ratio = m_min / m_max
        if ratio >= params.theta_d:
            return no_change(f"memory: M_min/M_max {ratio:.3f} >= theta_d {params.theta_d}", interval)
        if snapshot.last_adaptation_s is not None:
            since = snapshot.now_s - snapshot.last_adaptation_s
            if since < params.min_span_s:
                return no_change(
                    f"memory: {since:.1f} s since the last adaptation < min span {params.min_span_s} s",
                    interval,
                )
        budget = (m_max - m_min) // 2
        if receiver.memory_limit_bytes > 0:
            budget = min(budget, max(0, receiver.memory_limit_bytes - m_min))
        candidates = [
            stats
            for pid in snapshot.assignment.pids_of(sender.instance)
            if (stats := snapshot.pids.get(pid)) is not None
            and stats.state_bytes > 0
            and stats.spilled_bytes == 0
        ]
        candidates.sort(key=lambda s: (-Fraction(s.results, s.state_bytes), s.pid))
        moves: list[Move] = []
        moved = 0
        for stats in candidates:
            if moved + stats.state_bytes <= budget:
                moves.append(Move(stats.pid, sender.instance, receiver.instance, params.mode))
                moved += stats.state_bytes
        pair = f"{sender.instance}->{receiver.instance}"
        if not moves:
            return no_change(f"memory: {pair}: no pid fits the budget of {budget} bytes", interval)
        reason = (
            f"memory: {pair}: M_min/M_max {ratio:.3f} < theta_d {params.theta_d}; "
            f"moving {len(moves)} pid(s), {moved} of a {budget}-byte budget"
        )
        return Decision(tuple(moves), reason, interval)
