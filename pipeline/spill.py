"""Spilling a pid's window out of memory and cleaning up after it (Liu and Rundensteiner, section 4),
as pure rules: which pids spill, what a batch's plan carries about them, and when clean-up is due.

A spilled pid's old generation goes back to the input log, not to a disk: the plan records its spill
point (per stream, the offset where the new generation begins) and the window leaves memory (a
`SPILL_ROW` marker; the window's `stream_max` stays, so lateness is judged as before). New tuples form a
new generation that joins only with itself. Every result within one generation is produced as usual;
what is missing is exactly the results whose tuples span generations. A new generation that outgrows
memory in turn spills again: the plan adds a spill point, and a third generation begins (Liu and
Rundensteiner's repeated spills of one partition group; without them a spilled pid's new generation
grows back to a whole window within W, and spilling cannot hold a join under a budget below its working
set).

Clean-up produces the missing results, once, in one batch: it drops the newest generation, rebuilds the
window at the first spill point from the log (`InputFacts.replay_from`), then re-reads each later
generation in order, joined with the window of the generations before it only (a parallel track's old
side, `join.begin_old_track`), which then takes it in. A result whose newest tuple is of generation g
and which spans generations is made exactly once, by generation g's re-read. What is left is the whole
window, as if the pid had never spilled, and the batch goes on from there. docs/memory.md says why the
log and not a disk.

Clean-up always runs before a spilled pid leaves the instance (a release or the start of an overlap
in the same batch), so a spill point never travels with a handoff.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pipeline.join import NO_WATERMARK, horizons


class CleanupWhen(str, Enum):
    """When a spilled pid is cleaned up (besides before it leaves the instance, always)."""

    ACTIVE = "active"
    """As soon as its old generation has left the window (the clean-up brings nothing back into
    memory) while the instance is not behind, or once its input pauses."""
    LAZY = "lazy"
    """Only once its input pauses (the input ended, or the pid went quiet): the whole clean-up waits
    for the load to drop, as Liu and Rundensteiner's clean-up waits for the end of the run."""


class SpillChoice(str, Enum):
    """Which pids spill first."""

    LEAST_PRODUCTIVE = "least-productive"
    """Fewest results per byte of state first (their large P_s / P_o), pids without results first: what
    stays in memory keeps producing, and clean-up has the fewest results to make."""
    MOST_PRODUCTIVE = "most-productive"
    """The reverse order, for the paper's comparison only."""


Cutoff = Mapping[str, int]
"""Per stream, the offset of a generation's first tuple."""


def spill_points(found: Any) -> tuple[Cutoff, ...]:
    """A pid's spill points as JSON wrote them, oldest first: a list, or the one mapping plans, commit
    markers and handoffs held before a pid could spill again."""
    points = [found] if isinstance(found, Mapping) else found
    return tuple({s: int(o) for s, o in c.items()} for c in points)


def _cutoffs(d: Mapping[str, Any]) -> tuple[Cutoff, ...]:
    """A plan's spill points: `cutoffs`, or the one `cutoff` plans held before a pid could spill again."""
    return spill_points(d["cutoffs"] if "cutoffs" in d else d["cutoff"])


@dataclass(frozen=True, slots=True)
class Spill:
    """A pid whose old generations are out of memory, carried in every batch's plan until its clean-up."""

    cutoffs: tuple[Cutoff, ...]
    """Where each generation after the first begins, oldest first: one spill point per spill. A spilled
    pid whose new generation outgrows memory again spills again (up to `rows.MAX_SPILLS` times)."""
    state_bytes: int
    """What its windows held when they left memory (as the batch before each spill reported it)."""
    stream_max: list[int] | None
    """The window's `stream_max` at the first spill point, when the sink noted it: the rebuilt window's."""
    newest_max: list[int] | None = None
    """The same at the newest spill point, when the pid spilled again (else `stream_max`): clean-up is
    free of memory once the newest generation's input has moved every older tuple out of the window."""

    @property
    def last_max(self) -> list[int] | None:
        return self.newest_max if len(self.cutoffs) > 1 else self.stream_max

    def again(self, cutoff: Cutoff, state_bytes: int, stream_max: list[int] | None) -> Spill:
        """The same pid spilled once more at `cutoff`: its newest generation leaves memory too."""
        return Spill((*self.cutoffs, cutoff), self.state_bytes + state_bytes, self.stream_max, stream_max)

    def to_json(self) -> dict[str, Any]:
        cutoffs = [dict(c) for c in self.cutoffs]
        out = {"cutoffs": cutoffs, "state_bytes": self.state_bytes, "stream_max": self.stream_max}
        return out | ({"newest_max": self.newest_max} if len(self.cutoffs) > 1 else {})

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Spill:
        def times(key: str) -> list[int] | None:
            found = d.get(key)
            return [int(t) for t in found] if found is not None else None

        return cls(
            cutoffs=_cutoffs(d),
            state_bytes=int(d.get("state_bytes", 0)),
            stream_max=times("stream_max"),
            newest_max=times("newest_max"),
        )


@dataclass(frozen=True, slots=True)
class Cleanup:
    """A spilled pid's clean-up in this batch: the window at the first spill point rebuilt from
    `replay_from`, then each later generation re-read in turn, from its cutoff up to the next one (the
    last up to `to`, where this batch begins reading the pid), joined with the generations before it
    only (`generations`)."""

    replay_from: Cutoff
    cutoffs: tuple[Cutoff, ...]
    to: Cutoff

    def generations(self, stream: str) -> list[tuple[int, int]]:
        """Per generation after the first, its offsets [from, to) in `stream`."""
        ends = [*(c[stream] for c in self.cutoffs[1:]), self.to[stream]]
        return [(c[stream], e) for c, e in zip(self.cutoffs, ends, strict=True)]

    def to_json(self) -> dict[str, Any]:
        cutoffs = [dict(c) for c in self.cutoffs]
        return {"replay_from": dict(self.replay_from), "cutoffs": cutoffs, "to": dict(self.to)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Cleanup:
        return cls(
            replay_from={s: int(o) for s, o in d["replay_from"].items()},
            cutoffs=_cutoffs(d),
            to={s: int(o) for s, o in d["to"].items()},
        )


def deferred(spill: Spill, begin: Mapping[str, int]) -> bool:
    """Whether a spilled pid has read input since its first spill point, up to `begin`: only then can
    a result span its generations and wait for its clean-up. One that has not is parked."""
    return any(begin.get(s, o) > o for s, o in spill.cutoffs[0].items())


def spilled_of(offset: Mapping[str, Any]) -> dict[int, Spill]:
    return {int(p): Spill.from_json(s) for p, s in offset.get("spilled", {}).items()}


def cleanups_of(offset: Mapping[str, Any]) -> dict[int, Cleanup]:
    return {int(p): Cleanup.from_json(c) for p, c in offset.get("cleanups", {}).items()}


def choose_spills(
    held: Mapping[int, int],
    results: Mapping[int, int],
    budget: int,
    threshold: float,
    fraction: float,
    choice: SpillChoice,
    candidates: Sequence[int],
    incoming: int = 0,
) -> list[int]:
    """The pids to spill when the windows, with the `incoming` bytes the next batch is expected to
    add, would hold more than `threshold` of `budget`: about `fraction` of what they hold, or more
    when that would leave them over the threshold (a budget cut to half what the windows hold is
    answered in one batch), whole pids from `candidates` in the order `choice` says (ties by pid).
    `held` is each pid's window in bytes, `results` what it produced lately. Empty when under the
    threshold.

    Why `incoming`: the spill is planned by the next batch, which adds its input to the windows that
    stay; spilling down to the threshold of what they hold now would leave a batch of input over it."""
    total = sum(held.values())
    if budget <= 0 or threshold <= 0 or total + incoming <= threshold * budget:
        return []
    to_free = max(fraction * total, total + incoming - threshold * budget)

    def productivity(p: int) -> float:
        return results.get(p, 0) / held[p]

    order = sorted((p for p in candidates if held.get(p, 0) > 0), key=lambda p: (productivity(p), p))
    if choice is SpillChoice.MOST_PRODUCTIVE:
        order = sorted(order, key=lambda p: (-productivity(p), p))
    chosen, freed = [], 0
    for p in order:
        if freed >= to_free:
            break
        chosen.append(p)
        freed += held[p]
    return chosen


def batch_room(held: Mapping[int, int], spilled: Sequence[int], budget: int, bytes_per_tuple: float) -> int:
    """How many tuples the next batch may read: what the budget leaves of the windows once the `spilled`
    pids are out of memory, at `bytes_per_tuple` a window tuple (decision 0067). Counted as if every
    tuple stayed in a window, though older ones leave as event time moves on: the bound errs on the
    side of the budget. Zero when nothing is left; the source still reads a message a batch."""
    leaving = set(spilled)
    left = sum(b for p, b in held.items() if p not in leaving)
    return max(0, int((budget - left) // bytes_per_tuple))


def old_generation_gone(
    spill_max: Sequence[int], stream_max: Sequence[int], window_ms: int, lateness_ms: int
) -> bool:
    """Whether the input up to `stream_max` has moved every old tuple (event time at most
    spill_max[i] in stream i) out of the window, by the window's own purge rule (`join.horizons`; the
    test a parallel track's new side ends by). Clean-up then brings nothing back into memory: it only
    makes the results that span the generations."""
    keep_from = horizons(tuple(stream_max), window_ms, lateness_ms)
    return all(t == NO_WATERMARK or t < h for t, h in zip(spill_max, keep_from, strict=True))
