"""How much input the source's next batch takes: whole pids round robin within a bound of input
messages and of the results they make (decisions 0045, 0055), and how fast input arrives (whether the
instance is behind).

Pure (no Kafka, no Spark): the source hands it the offsets it fetched and the recent yields the sink
noted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Offsets = dict[str, dict[str, int]]  # stream -> str(pid) -> next offset to read

RESULTS_HEADROOM = 3.0
"""Batches are planned at a third of `max_results`: while a pid's window fills (its first batches, or
after a move), each new tuple finds more partners than the last batch's did. With two streams a batch
that starts from an empty window makes up to three times as many results per tuple once the window
holds as many tuples as the batch (twice from the window, once from each other); measured: 3.1x."""


Yield = tuple[int, int, int]
"""A batch of one pid as the sink noted it: tuples read, results made, and the combinations of its own
tuples that share a key (`join.key_combinations`: the most results it could make within itself)."""


def results_of(tuples: float, recent: Sequence[Yield], streams: int) -> float:
    """About the most results `tuples` new tuples of one pid make, judged by its recent batches
    (decisions 0055, 0070). A pid never seen: the worst case, every tuple on one key within W, (n/m)^m."""
    if not recent:
        return float((tuples / streams) ** streams)
    return max((_judged_by(tuples, t, r, w, streams) for t, r, w in recent if t), default=0.0)


def _judged_by(n: float, t: int, r: int, w: int, streams: int) -> float:
    """The results of n tuples, judged by a batch of t tuples that made r, w of whose combinations
    share a key. Up to t tuples, (r+1)/t per tuple (+1: a batch without results does not make the next
    one free). Beyond t, two parts (decision 0070):

    - with the window: (r + (m-1)w + 1)/t per tuple, growing with n only linearly. The window the
      next batch meets also holds the last batch's tuples: their combinations within it, w, become
      partners of the next batch's tuples, m-1 for each (an upper bound: w counts keys, not W).
    - within the batch: (w+1)(n/t)^m, the batch's own key combinations grown as a sample's grow with
      its size (exact for a hot key's tuples, all on one key).

    Judging every result as if made within the batch (the growth bound of decision 0055) kept an
    instance that fell behind from catching up: a backlog many times its last batch looked like a hot
    key's, so a batch took one pid or two while a second's worth of input arrived for all 64.
    """
    if n <= t:
        return (r + 1) / t * n
    return (r + (streams - 1) * w + 1) / t * n + (w + 1) * (n / t) ** streams


def tuples_within(results: float, recent: Sequence[Yield], streams: int) -> float:
    """The most new tuples of one pid whose `results_of` stays within `results` (found by bisection:
    `results_of` grows with the tuples)."""
    if results <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while results_of(high, recent, streams) <= results and high < 1e15:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if results_of(middle, recent, streams) <= results else (low, middle)
    return low


@dataclass(frozen=True, slots=True)
class BatchBound:
    """What bounds a batch: `messages` input messages, about `results` results (`results_of` per pid,
    from `yields`), `per_message` tuples a message (sampled), `streams` joined."""

    messages: float
    results: float
    per_message: float
    streams: int
    yields: Mapping[int, Sequence[Yield]]


def pids_within(
    start: Offsets, latest: Offsets, bound: BatchBound, first_pid: int
) -> tuple[Offsets, int | None]:
    """End offsets of a batch within `bound`, taking whole pids (every stream of a pid up to its latest
    offset) round robin from `first_pid`; returns them and the pid to start from next time (None when
    every pid was taken whole). A first pid that alone is over the bound is cut: each of its streams
    the same share of its backlog (at least one message in all); the next batch begins with the pid
    after it, so a hot pid's backlog takes one slice a round and never holds the others back.

    Whole pids keep a pid's streams close in event time: cutting each stream's backlog separately lets
    a sparse stream run seconds ahead of a dense one, and the window then holds the sparse stream's
    tuples until the dense one catches up (lateness does not depend on it, decision 0047). Results do
    not depend on where a batch ends, so a cut pid's output is the same.
    """
    streams = list(latest)
    pids = sorted(int(p) for p in latest[streams[0]])
    if not pids:
        return latest, None
    order = [p for p in pids if p >= first_pid] + [p for p in pids if p < first_pid]
    out: Offsets = {
        s: {str(p): start.get(s, {}).get(str(p), latest[s][str(p)]) for p in pids} for s in streams
    }
    messages, results, taken = bound.messages, bound.results, False
    for i, p in enumerate(order):
        backlog = {s: latest[s][str(p)] - out[s][str(p)] for s in streams}
        size = sum(backlog.values())
        if not size:
            continue
        recent = bound.yields.get(p, ())
        if not recent and not taken and len(_new_pids_waiting(out, latest, bound, order, i)) > 1:
            # Taken whole, the first few new pids' worst cases would use up the bound (a pid of 1,600
            # tuples counts as 640,000 results); in slices, many make the same worst case with more
            # tuples in all (decision 0072).
            return _slices_of_new_pids(out, latest, bound, order, i)
        fits = min(messages, tuples_within(results, recent, bound.streams) / bound.per_message)
        if size <= fits:
            for s in streams:
                out[s][str(p)] = latest[s][str(p)]
            messages -= size
            results -= results_of(size * bound.per_message, recent, bound.streams)
            taken = True
            continue
        if taken:  # this pid waits for the next batch
            return out, p
        if not recent:
            return _slices_of_new_pids(out, latest, bound, order, i)
        for s, n in _shares(backlog, max(1, int(fits))).items():
            out[s][str(p)] += n
        return out, order[(i + 1) % len(order)]
    return out, None


def _slices_of_new_pids(
    start: Offsets, latest: Offsets, bound: BatchBound, order: Sequence[int], first: int
) -> tuple[Offsets, int]:
    """A batch that begins with a pid never seen: it and the next pids never seen share the bound, each
    an equal share of the messages and of the results, its slice judged by the worst case (`results_of`
    with nothing known, (n/m)^m). As many share it as can each have a message of every stream: a slice
    of some streams only makes no results, and its pid's next batch would be planned from nothing.

    The worst case grows faster than the tuples: k slices of n tuples make k times one slice's worst
    case, where one pid of k*n tuples would make k^m times it. So k new pids read together in one batch
    what one new pid alone would read in k batches, and the next batch plans each from its own history.
    Read one at a time, an instance's first batches were one pid each (docs/benchmarks.md).
    """
    streams = list(latest)
    new = _new_pids_waiting(start, latest, bound, order, first)
    m = bound.streams
    # k slices of m messages each: k * (m * per_message / m)^m results at worst, k * m messages
    k = int(min(len(new), bound.results / bound.per_message**m, bound.messages / m)) or 1
    new = new[:k]
    per_pid = min(bound.messages / k, tuples_within(bound.results / k, (), bound.streams) / bound.per_message)
    out = {s: dict(offsets) for s, offsets in start.items()}
    for _, p in new:
        backlog = {s: latest[s][str(p)] - start[s][str(p)] for s in streams}
        for s, n in _shares(backlog, max(1, min(sum(backlog.values()), int(per_pid)))).items():
            out[s][str(p)] += n
    return out, order[(new[-1][0] + 1) % len(order)]


def _new_pids_waiting(
    start: Offsets, latest: Offsets, bound: BatchBound, order: Sequence[int], first: int
) -> list[tuple[int, int]]:
    """(index in `order`, pid) of the pids from `order[first]` on that were never seen and have input
    waiting."""
    return [
        (i, p)
        for i, p in enumerate(order[first:], start=first)
        if not bound.yields.get(p) and any(latest[s][str(p)] > start[s][str(p)] for s in latest)
    ]


def _shares(backlog: Mapping[str, int], total: int) -> dict[str, int]:
    """`total` messages spread over the streams in proportion to their backlogs (largest remainders
    first): a slice of a few messages would lose most of itself to rounding each stream down."""
    size = sum(backlog.values())
    exact = {s: n * total / size for s, n in backlog.items()}
    out = {s: int(x) for s, x in exact.items()}
    for s in sorted(exact, key=lambda s: exact[s] - out[s], reverse=True)[: total - sum(out.values())]:
        out[s] += 1
    return out


@dataclass(slots=True)
class ArrivalMeter:
    """Messages appended to an instance's pids per second, measured between two batch plans (the
    latest offsets the source fetches anyway)."""

    seen_at: float | None = None
    seen: dict[tuple[str, str], int] = field(default_factory=dict)
    rate: float | None = None  # messages per second; None until two plans have been seen

    def observe(self, latest: Offsets, now: float) -> None:
        common = [(s, p) for s in latest for p in latest[s] if (s, p) in self.seen]
        if self.seen_at is not None and now > self.seen_at and common:
            grown = sum(latest[s][p] - self.seen[(s, p)] for s, p in common)
            self.rate = max(0, grown) / (now - self.seen_at)
        self.seen = {(s, p): o for s in latest for p, o in latest[s].items()}
        self.seen_at = now

    def behind(self, waiting: int, horizon_s: float) -> bool:
        """True when the `waiting` messages exceed what arrives in `horizon_s` seconds; never while the
        rate is unknown."""
        return self.rate is not None and waiting > self.rate * horizon_s
