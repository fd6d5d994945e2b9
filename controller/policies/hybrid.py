"""Flux's hybrid repartitioning (Shah et al., ICDE 2003, section 6.4): memory first, then load.

"If any operator instance has partitions spilled to disk, the hybrid policy resorts to the memory-based
policy to avoid high average latencies. If partitions for all instances are resident in memory, it
resorts to the load-balancing policy to improve throughput, subject to the constraint that a partition
is moved only if sufficient memory exists at the destination site."

Where the paper leaves room, this module chooses as follows:

- "Spilled" is an instance that has spilled state not cleaned up yet (`InstanceStats.spilled_bytes`,
  docs/memory.md), or holds more state than its budget: the point at which it would spill, where
  spilling is off. Then the round is `FluxMemoryPolicy`'s.
- Otherwise the round is `FluxPolicy`'s with the hybrid's parameters, and each of its moves is kept only
  while the receiver's budget still holds the pid's state after the moves kept before it; a receiver that
  reports no budget takes any. A round whose moves are all refused moves nothing and says so.
- The parameters are the load balancing policy's (`FluxParams`); the memory round uses its th_imb and
  handoff mode, one pid per pair as in the paper.
"""

from __future__ import annotations

from controller.assignment import Move
from controller.policies.base import Decision, Snapshot
from controller.policies.flux import FluxParams, FluxPolicy
from controller.policies.flux_memory import FluxMemoryParams, FluxMemoryPolicy


class HybridPolicy:
    """The memory-constrained round while an instance has spilled state or is over its budget, else load
    balancing that never pushes a receiver over its budget."""

    name = "hybrid"

    def default_params(self) -> FluxParams:
        return FluxParams()

    def decide(self, snapshot: Snapshot, params: FluxParams) -> Decision:
        over = [
            s.instance
            for s in snapshot.instances
            if s.spilled_bytes > 0 or (s.memory_limit_bytes > 0 and s.state_bytes > s.memory_limit_bytes)
        ]
        if over:
            memory = FluxMemoryParams(th_imb=params.th_imb, mode=params.mode)
            decided = FluxMemoryPolicy().decide(snapshot, memory)
            return Decision(
                decided.moves,
                f"hybrid, {', '.join(over)} spilled or over budget: {decided.reason}",
                decided.next_interval_s,
            )
        decided = FluxPolicy().decide(snapshot, params)
        spare = {s.instance: s.memory_limit_bytes - s.state_bytes for s in snapshot.instances}
        kept: list[Move] = []
        refused: list[int] = []
        for move in decided.moves:
            size = snapshot.pids[move.pid].state_bytes if move.pid in snapshot.pids else 0
            stats = snapshot.stats_of(move.target)
            if stats is not None and stats.memory_limit_bytes > 0 and size > spare[move.target]:
                refused.append(move.pid)
                continue
            kept.append(move)
            spare[move.target] -= size
            spare[move.source] += size
        reason = f"hybrid: {decided.reason}"
        if refused:
            reason += f"; pid(s) {', '.join(map(str, refused))} refused: no room in the receiver's budget"
        interval = decided.next_interval_s
        if not kept and interval is None:  # no move phase to wait for: flux's interval after no change
            interval = max(snapshot.interval_s / 2, params.delta_min_s)
        return Decision(tuple(kept), reason, interval, decided.balanced)
