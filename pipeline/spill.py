"""Spilling a pid's window out of memory and cleaning up after it (Liu and Rundensteiner, section 4),
as pure rules: which pids spill, what a batch's plan carries about them, and when clean-up is due.

A spilled pid's old generation goes back to the input log, not to a disk: the plan records its spill
point (per stream, the offset where the new generation begins) and the window leaves memory (a
`SPILL_ROW` marker; the window's `stream_max` stays, so lateness is judged as before). New tuples form a
new generation that joins only with itself. Every result of old tuples only was produced before the
spill, every result of new tuples only is produced as usual; what is missing is exactly the results
with at least one old and one new tuple. Clean-up produces those, once, in one batch: it drops the new
generation, rebuilds the window at the spill point from the log (`InputFacts.replay_from`), and re-reads
the new generation from the spill point to where the batch begins, joined with the old tuples only (a
parallel track's old side, `join.begin_old_track`). What that leaves is the whole window, as if the pid
had never spilled, and the batch goes on from there. docs/memory.md says why the log and not a disk.

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


@dataclass(frozen=True, slots=True)
class Spill:
    """A pid whose old generation is out of memory, carried in every batch's plan until its clean-up."""

    cutoff: dict[str, int]
    """Per stream, where the new generation begins: the offset of its first tuple."""
    state_bytes: int
    """What the window held when it left memory (as the batch before the spill reported it)."""
    stream_max: list[int] | None
    """The window's `stream_max` at the spill point, when the sink noted it: clean-up is free of memory
    once the new generation's input has moved every old tuple out of the window."""

    def to_json(self) -> dict[str, Any]:
        return {"cutoff": self.cutoff, "state_bytes": self.state_bytes, "stream_max": self.stream_max}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Spill:
        stream_max = d.get("stream_max")
        return cls(
            cutoff={s: int(o) for s, o in d["cutoff"].items()},
            state_bytes=int(d.get("state_bytes", 0)),
            stream_max=[int(t) for t in stream_max] if stream_max is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Cleanup:
    """A spilled pid's clean-up in this batch: the window at the spill point rebuilt from `replay_from`
    up to `cutoff`, then the new generation re-read from `cutoff` up to `to` (where this batch begins
    reading the pid) and joined with the old tuples only."""

    replay_from: dict[str, int]
    cutoff: dict[str, int]
    to: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"replay_from": self.replay_from, "cutoff": self.cutoff, "to": self.to}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Cleanup:
        return cls(
            replay_from={s: int(o) for s, o in d["replay_from"].items()},
            cutoff={s: int(o) for s, o in d["cutoff"].items()},
            to={s: int(o) for s, o in d["to"].items()},
        )


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
) -> list[int]:
    """The pids to spill when the windows hold more than `threshold` of `budget`: about `fraction` of
    what they hold, whole pids from `candidates` in the order `choice` says (ties by pid). `held` is
    each pid's window in bytes, `results` what it produced lately. Empty when under the threshold."""
    total = sum(held.values())
    if budget <= 0 or threshold <= 0 or total <= threshold * budget:
        return []

    def productivity(p: int) -> float:
        return results.get(p, 0) / held[p]

    order = sorted((p for p in candidates if held.get(p, 0) > 0), key=lambda p: (productivity(p), p))
    if choice is SpillChoice.MOST_PRODUCTIVE:
        order = sorted(order, key=lambda p: (-productivity(p), p))
    chosen, freed = [], 0
    for p in order:
        if freed >= fraction * total:
            break
        chosen.append(p)
        freed += held[p]
    return chosen


def old_generation_gone(
    spill_max: Sequence[int], stream_max: Sequence[int], window_ms: int, lateness_ms: int
) -> bool:
    """Whether the input up to `stream_max` has moved every old tuple (event time at most
    spill_max[i] in stream i) out of the window, by the window's own purge rule (`join.horizons`; the
    test a parallel track's new side ends by). Clean-up then brings nothing back into memory: it only
    makes the results that span the generations."""
    keep_from = horizons(tuple(stream_max), window_ms, lateness_ms)
    return all(t == NO_WATERMARK or t < h for t, h in zip(spill_max, keep_from, strict=True))
