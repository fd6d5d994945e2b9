"""Flux's memory-constrained repartitioning (Shah et al., ICDE 2003, section 6.2): balance the memory
the instances have to spare, not their utilization.

The round, as the paper gives it: each instance's *excess capacity* is the memory it has available minus
the state it holds (negative once it is over and spilling). Instances are sorted by it, the one with the
least paired with the one with the most, the second with the second, and so on towards the middle. For
each pair, the donor's pids are walked by decreasing size, in-memory ones first, and the first whose move
reduces the imbalance in excess capacity between the two moves. The threshold test is the load
balancing one without the receiver's utilization limit ("although memory may be exhausted, movement
would balance the number of on-disk partitions").

Where the paper leaves room, this module chooses as follows:

- Available memory is `InstanceStats.memory_limit_bytes`, the instance's state budget (configured, or
  set while it runs, docs/memory.md); held state is `InstanceStats.state_bytes`. An instance that reports
  no budget cannot take part, and the round waits until every live instance reports one.
- The threshold test compares *fill*, state over budget, as the load balancing test compares U: a pair
  fails when the donor's fill is below the mean fill, or donor fill / receiver fill < th_imb. The round
  stops at the first failing pair; the tests are monotone along the sorted pairs.
- A move of s bytes turns the pair's gap in excess capacity g into |g - 2s|, so it reduces the imbalance
  exactly when 0 < s < g.
- `max_moves_per_pair` (default 1, the paper's rule) lets a pair go on from its new excess capacities, as
  the load balancing policy's does (docs/load-model.md, "Which pids move").
- Pids in flight and pids with no state never move. Spilled pids (`PidStats.spilled_bytes`) are walked
  after the in-memory ones, as the paper walks on-disk partitions last: moving one first runs its
  clean-up on the donor, which brings its old generations back into memory.
- The next round comes after the snapshot's own interval: the paper halves only the load balancing
  interval, and memory changes with the windows, slower than load.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.assignment import HandoffMode, Move
from controller.policies.base import Decision, InstanceStats, Snapshot, no_change


@dataclass(frozen=True, slots=True, kw_only=True)
class FluxMemoryParams:
    """Threshold of the memory-constrained round, pids per pair, and the handoff mode of its moves."""

    th_imb: float = 1.2
    """The load balancing policy's imbalance threshold, applied to fill (state over budget)."""
    max_moves_per_pair: int = 1
    mode: HandoffMode = HandoffMode.TRANSFER

    def __post_init__(self) -> None:
        if self.th_imb < 1.0:
            raise ValueError(f"th_imb must be >= 1, got {self.th_imb}")
        if self.max_moves_per_pair < 1:
            raise ValueError(f"max_moves_per_pair must be >= 1, got {self.max_moves_per_pair}")


def fill(stats: InstanceStats) -> float:
    """State held over state budget: above 1 when over it."""
    return stats.state_bytes / stats.memory_limit_bytes


class FluxMemoryPolicy:
    """Pair the instances with the least and the most memory to spare; move big pids between them."""

    name = "flux-memory"

    def default_params(self) -> FluxMemoryParams:
        return FluxMemoryParams()

    def decide(self, snapshot: Snapshot, params: FluxMemoryParams) -> Decision:
        """One memory-constrained round, or the reason there is none."""
        interval = snapshot.interval_s
        unknown = sorted(s.instance for s in snapshot.instances if s.memory_limit_bytes <= 0)
        if unknown:
            return no_change(f"flux-memory: no state budget reported by {', '.join(unknown)}", interval)
        if len(snapshot.instances) < 2:
            return no_change("flux-memory: fewer than two live instances", interval)
        spare = {s.instance: s.memory_limit_bytes - s.state_bytes for s in snapshot.instances}
        ranked = sorted(snapshot.instances, key=lambda s: (spare[s.instance], s.instance))
        mean_fill = sum(fill(s) for s in ranked) / len(ranked)
        moves: list[Move] = []
        stopped = ""
        for k in range(len(ranked) // 2):
            donor, receiver = ranked[k], ranked[-1 - k]
            f_d, f_r = fill(donor), fill(receiver)
            ratio = f_d / f_r if f_r > 0 else float("inf")
            if f_d < mean_fill or ratio < params.th_imb:
                stopped = (
                    f"{donor.instance}->{receiver.instance}: fill {f_d:.3f} vs {f_r:.3f} "
                    f"(mean {mean_fill:.3f}, th_imb {params.th_imb})"
                )
                break
            moves += self._pair(snapshot, params, donor.instance, receiver.instance, spare)
        if not moves:
            why = f"balanced at {stopped}" if stopped else "no pid reduces any pair's gap"
            return no_change(f"flux-memory: {why}", interval, balanced=bool(stopped))
        moved = sum(snapshot.pids[m.pid].state_bytes for m in moves)
        return Decision(tuple(moves), f"flux-memory: moving {len(moves)} pid(s), {moved} bytes", interval)

    @staticmethod
    def _pair(
        snapshot: Snapshot, params: FluxMemoryParams, donor: str, receiver: str, spare: dict[str, int]
    ) -> list[Move]:
        """The donor's pids, in-memory ones first, biggest first, each moved while it reduces the pair's
        gap in spare memory."""
        sizes = [
            (stats.state_bytes, stats.spilled_bytes > 0, pid)
            for pid in snapshot.assignment.pids_of(donor)
            if pid not in snapshot.moves_in_flight
            and (stats := snapshot.pids.get(pid)) is not None
            and stats.state_bytes > 0
        ]
        moves: list[Move] = []
        for size, _, pid in sorted(sizes, key=lambda item: (item[1], -item[0], item[2])):
            if len(moves) == params.max_moves_per_pair:
                break
            if 0 < size < spare[receiver] - spare[donor]:
                moves.append(Move(pid, donor, receiver, params.mode))
                spare[donor] += size
                spare[receiver] -= size
        return moves
