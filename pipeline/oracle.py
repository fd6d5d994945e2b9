"""The oracle: what the results topic must hold, judged from the input topics alone.

fluxjoin's own output (its results and its dead letters) is what is checked, so none of it may shape
what is expected. The verifier once dropped dead-lettered tuples from the expected join, and printed
EXACT for a run that had dead-lettered 2.7% of its tuples as late while none was late at its source,
and had lost 7.9% of its results (decision 0047). So lateness is recomputed here from each input
partition in offset order, the one order Kafka fixes, and the dead letters are compared with it.

The expected join grows with the product of the streams (a hot key's windows multiply), far beyond its
input, so it is counted and never built: memory stays proportional to the input and the produced ids,
however many results are expected. Counting is enough because each produced result can be judged on
its own (its tuples exist, are on time, share a key and lie within W): distinct valid results are
expected ones, so the missing ones are counted as the difference.

Input the rule cannot judge is reported, not guessed at: records that do not decode, or hold a key
of another pid or a negative id, are malformed (the instances dead-letter them whole); ids that occur
twice in a stream make results, which are named by ids, ambiguous, so such a report is never exact. A
topic whose partition count is not the configured one breaks pid == partition index: the check stops.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.codec import Malformation, MalformedRecord, decode_results, decode_tuple_columns, progress_of
from pipeline.config import Config
from pipeline.join import Part
from pipeline.partitioning import pids_of
from pipeline.topics import (
    DEFAULT_TIMEOUT_S,
    TopicError,
    admin_client,
    check_reachable,
    read_records,
)

I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

COUNT_CHUNK = 1 << 20
"""Tuples taken as a combination's first element at a time while counting: the searches of one chunk
hold a few arrays of this length."""

CHECK_ROWS = 1 << 20
"""Produced results judged at a time; only the valid ones are kept for counting distinct ones."""

DEDUPE_BUCKETS = 16
"""Valid produced results are held in buckets of their stream-0 id, and made distinct one bucket at a
time: sorting all of them at once would take a second copy of every id."""

INT64_MAX = int(np.iinfo(np.int64).max)


def _quiet(_message: str) -> None:
    pass


@dataclass(frozen=True)
class VerifyReport:
    input_tuples: int
    """Well-formed tuples in the input topics, late or not."""
    progress_records: int
    malformed: int
    """Input records that do not decode, or hold a key of another pid or a negative id (skipped whole,
    as the instances do)."""
    duplicate_input_ids: int
    """Tuples whose id occurred before in their stream: results are named by ids, so not exact."""
    late_expected: int
    """Tuples late by the rule of decision 0047, computed from the input topics."""
    late_reported: int
    """Late records in the dead-letter topic."""
    wrongly_late: int
    """Distinct tuples dead-lettered as late that are not late by the rule (their results are missing)."""
    late_unreported: int
    """Tuples late by the rule that no dead letter reports."""
    expected: int
    produced: int
    missing: int
    duplicate: int
    spurious: int
    """Produced results that are no result of the input (and results records that do not decode)."""
    missing_by_pid: dict[int, int] = field(default_factory=dict)
    """Where missing results belong (pid of their key): a loss is traced to the moves of that pid."""

    @property
    def exact(self) -> bool:
        return (
            self.missing == 0
            and self.duplicate == 0
            and self.spurious == 0
            and self.wrongly_late == 0
            and self.late_unreported == 0
            and self.duplicate_input_ids == 0
        )

    @property
    def subset(self) -> bool:
        """Everything produced is an expected result, once: what output must be while results are
        still due (spilled pids before their clean-up, input not processed yet), missing ones allowed.
        A tuple dead-lettered although on time would lose its results for good, so it fails this too."""
        return (
            self.duplicate == 0
            and self.spurious == 0
            and self.wrongly_late == 0
            and self.duplicate_input_ids == 0
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"exact": self.exact, "subset": self.subset}

    def describe(self) -> str:
        verdict = "EXACT" if self.exact else "NOT EXACT"
        lines = [
            f"input tuples {self.input_tuples:,}  progress records {self.progress_records:,}  "
            f"malformed records {self.malformed:,}  duplicate input ids {self.duplicate_input_ids:,}",
            f"late by the rule {self.late_expected:,}  dead-lettered as late {self.late_reported:,}  "
            f"wrongly late {self.wrongly_late:,}  late but unreported {self.late_unreported:,}",
            f"expected {self.expected:,}  produced {self.produced:,}  missing {self.missing:,}  "
            f"duplicate {self.duplicate:,}  spurious {self.spurious:,}  -> {verdict}",
        ]
        if not self.exact and self.subset:
            lines.append("a subset of the exact result: nothing duplicate or spurious, only results missing")
        if self.missing_by_pid:
            lines.append(f"missing by pid {self.missing_by_pid}")
        if self.duplicate_input_ids:
            lines.append(
                f"not exact: {self.duplicate_input_ids:,} input tuples repeat an id of their stream, and "
                "results are named by ids, so the counts above cannot be exact"
            )
        if self.wrongly_late:
            lines.append("tuples dead-lettered as late although on time lose their results (missing)")
        return "\n".join(lines)


# --- the pure core: per-partition arrays in, counts out ---


@dataclass(frozen=True, slots=True)
class PartitionLog:
    """One input partition (a stream's topic; partition index == pid) in offset order: the event time
    of every element (each tuple of each record in its order, each progress record), which elements
    are tuples, and the tuples' ids and keys (in the same order)."""

    pid: int
    times: I64
    is_tuple: Bools
    ids: I64
    keys: I64

    @property
    def progress_records(self) -> int:
        return int(len(self.is_tuple) - np.count_nonzero(self.is_tuple))


def late_mask(times: I64, is_tuple: Bools, lateness_ms: int) -> Bools:
    """For each tuple of a partition (elements in offset order): is its event time below the largest
    event time of the elements before it minus the allowed lateness? The first element never is."""
    if not len(times):
        return np.zeros(0, dtype=np.bool_)
    before = np.empty_like(times)
    before[0] = times[0]
    np.maximum.accumulate(times[:-1], out=before[1:])
    # before - times in uint64 is exact wherever before > times: no overflow at extreme event times.
    late = (before > times) & (before.astype(np.uint64) - times.astype(np.uint64) > np.uint64(lateness_ms))
    return late[is_tuple]


@dataclass(frozen=True)
class StreamInput:
    """One stream's input, judged: the on-time tuples (those that may join) and the late ones' ids."""

    on_time: Part
    late_ids: I64
    tuples: int
    progress_records: int
    duplicate_ids: int


def stream_input(logs: Sequence[PartitionLog], lateness_ms: int) -> StreamInput:
    ids: list[I64] = []
    keys: list[I64] = []
    ts: list[I64] = []
    late_ids: list[I64] = []
    for log in logs:
        is_late = late_mask(log.times, log.is_tuple, lateness_ms)
        on_time = ~is_late
        ids.append(log.ids[on_time])
        keys.append(log.keys[on_time])
        ts.append(log.times[log.is_tuple][on_time])
        late_ids.append(log.ids[is_late])
    part = Part(*(np.concatenate(c) if c else np.empty(0, np.int64) for c in (ids, keys, ts)))
    late = np.concatenate(late_ids) if late_ids else np.empty(0, np.int64)
    all_ids = np.concatenate([part.ids, late])
    return StreamInput(
        on_time=part,
        late_ids=late,
        tuples=len(all_ids),
        progress_records=sum(log.progress_records for log in logs),
        duplicate_ids=len(all_ids) - len(np.unique(all_ids)),
    )


@dataclass(frozen=True)
class Expected:
    total: int
    by_pid: list[int]


class _Tally:
    """Sums of per-combination-start products, overall and by pid: int64 while it cannot overflow,
    Python ints after (products of m - 1 counts, and their sum, may exceed 2**63)."""

    def __init__(self, partitions: int, int64_bound: float) -> None:
        self.total = 0
        self.by_pid: np.ndarray = np.zeros(partitions, dtype=np.int64)
        self.bound = int64_bound

    def add(self, counts: list[I64], pids: npt.NDArray[np.int32]) -> None:
        estimate = np.prod(np.stack(counts).astype(np.float64), axis=0)
        if self.by_pid.dtype == np.int64 and float(self.total) + float(estimate.sum()) < self.bound:
            product = counts[0].copy()
            for c in counts[1:]:
                product *= c
        else:
            self.by_pid = self.by_pid.astype(object)
            product = np.prod(np.stack(counts).astype(object), axis=0)
        self.total += int(product.sum())
        np.add.at(self.by_pid, pids, product)

    def result(self) -> Expected:
        return Expected(self.total, [int(n) for n in self.by_pid])


def count_expected(
    parts: Sequence[Part],
    window_ms: int,
    partitions: int,
    chunk: int = COUNT_CHUNK,
    int64_bound: float = 2.0**62,
) -> Expected:
    """How many combinations of one tuple per stream share a key and lie within `window_ms` (max - min
    <= W), overall and by the pid of their key; without listing them.

    A combination is counted once, at its first element: the one with the smallest (event time, stream
    index). Taking tuple x of stream i as first, its combinations number the product over j != i of
    the tuples of stream j with x's key and an event time in [x.ts, x.ts + W] ((x.ts, x.ts + W] for
    j < i, which would come first at a tie)."""
    tally = _Tally(partitions, int64_bound)
    if len(parts) < 2 or any(len(p) == 0 for p in parts):
        return tally.result()
    uniq = np.unique(np.concatenate([p.keys for p in parts]))
    pid_of_rank = pids_of(uniq, partitions)
    ranks = [np.searchsorted(uniq, p.keys).astype(np.int64) for p in parts]
    tmin = min(int(p.ts.min()) for p in parts)
    tmax = max(int(p.ts.max()) for p in parts)
    span = tmax - tmin + window_ms + 1  # a key's event times and their windows, with no overlap of keys
    if len(uniq) * span <= INT64_MAX:
        _count_composite(parts, ranks, tmin, span, window_ms, pid_of_rank, chunk, tally)
    else:
        _count_by_key(parts, ranks, len(uniq), window_ms, pid_of_rank, tally)
    return tally.result()


def _count_composite(
    parts: Sequence[Part],
    ranks: list[I64],
    tmin: int,
    span: int,
    window_ms: int,
    pid_of_rank: npt.NDArray[np.int32],
    chunk: int,
    tally: _Tally,
) -> None:
    """(key rank, event time) as one sortable int64 per tuple: one searchsorted per stream and chunk."""
    composite = []
    for p, r in zip(parts, ranks, strict=True):
        c = r * np.int64(span) + (p.ts - np.int64(tmin))
        c.sort()
        composite.append(c)
    for i, ci in enumerate(composite):
        for lo in range(0, len(ci), chunk):
            x = ci[lo : lo + chunk]
            end = x + np.int64(window_ms)
            counts = [
                np.searchsorted(cj, end, "right") - np.searchsorted(cj, x, "left" if j > i else "right")
                for j, cj in enumerate(composite)
                if j != i
            ]
            tally.add(counts, pid_of_rank[x // np.int64(span)])


def _count_by_key(
    parts: Sequence[Part],
    ranks: list[I64],
    n_keys: int,
    window_ms: int,
    pid_of_rank: npt.NDArray[np.int32],
    tally: _Tally,
) -> None:
    """The same count key by key, for event times too far apart to share an int64 with key ranks."""
    times, bounds = [], []
    for p, r in zip(parts, ranks, strict=True):
        order = np.lexsort((p.ts, r))
        times.append(p.ts[order])
        bounds.append(np.searchsorted(r[order], np.arange(n_keys + 1)))
    present = np.logical_and.reduce([np.diff(b) > 0 for b in bounds])
    for k in np.flatnonzero(present):
        seg = [t[b[k] : b[k + 1]] for t, b in zip(times, bounds, strict=True)]
        for i, x in enumerate(seg):
            end = np.where(x > INT64_MAX - window_ms, INT64_MAX, x + np.int64(window_ms))
            counts = [
                np.searchsorted(s, end, "right") - np.searchsorted(s, x, "left" if j > i else "right")
                for j, s in enumerate(seg)
                if j != i
            ]
            tally.add(counts, np.full(len(x), pid_of_rank[k], dtype=np.int32))


class _Lookup:
    """The on-time tuples of every stream by id (sorted ids and searchsorted)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.ids, self.keys, self.ts = [], [], []
        for p in parts:
            order = np.argsort(p.ids, kind="stable")
            self.ids.append(p.ids[order])
            self.keys.append(p.keys[order])
            self.ts.append(p.ts[order])

    def find(self, j: int, ids: I64) -> tuple[Bools, I64, I64]:
        """Whether each id is an on-time tuple of stream j, and its key and event time (garbage if not)."""
        known = self.ids[j]
        if not len(known):
            zero = np.zeros(len(ids), np.int64)
            return np.zeros(len(ids), np.bool_), zero, zero
        pos = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        return known[pos] == ids, self.keys[j][pos], self.ts[j][pos]

    def valid(self, rows: npt.NDArray[np.int64], window_ms: int) -> Bools:
        """Which produced results (an (m, n) id array) are results of the on-time input."""
        ok, key, lo = self.find(0, rows[0])
        hi = lo
        for j in range(1, rows.shape[0]):
            found, k, t = self.find(j, rows[j])
            ok &= found & (k == key)
            lo, hi = np.minimum(lo, t), np.maximum(hi, t)
        return ok & (hi.astype(np.uint64) - lo.astype(np.uint64) <= np.uint64(window_ms))


@dataclass(frozen=True)
class Produced:
    produced: int
    spurious: int
    duplicate: int
    distinct_by_pid: list[int]


def check_produced(
    parts: Sequence[Part],
    batches: Iterable[npt.NDArray[np.int64] | None],
    window_ms: int,
    partitions: int,
) -> Produced:
    """Judge each produced result on its own against the on-time tuples `parts`, then count the
    distinct valid ones by pid. `batches` are (m, n) id arrays as decoded (id j is stream j's), None
    for a results record that did not decode (one spurious result)."""
    m = len(parts)
    lookup = _Lookup(parts)
    buckets: list[list[I64]] = [[] for _ in range(DEDUPE_BUCKETS)]
    produced = spurious = 0
    pending: list[I64] = []
    pending_rows = 0

    def judge_pending() -> None:
        nonlocal spurious, pending_rows
        if not pending:
            return
        rows = np.hstack(pending)
        pending.clear()
        pending_rows = 0
        ok = lookup.valid(rows, window_ms)
        spurious += int(len(ok) - np.count_nonzero(ok))
        kept = rows[:, ok]
        bucket = kept[0] % DEDUPE_BUCKETS
        for b in np.unique(bucket):
            buckets[b].append(kept[:, bucket == b])

    for batch in batches:
        if batch is None:
            produced += 1
            spurious += 1
            continue
        n = batch.shape[1] if batch.ndim == 2 else batch.size
        produced += n
        if batch.ndim != 2 or batch.shape[0] != m:
            spurious += n
            continue
        pending.append(batch)
        pending_rows += n
        if pending_rows >= CHECK_ROWS:
            judge_pending()
    judge_pending()

    valid = 0
    distinct_by_pid = np.zeros(partitions, dtype=np.int64)
    for b, chunks in enumerate(buckets):
        if not chunks:
            continue
        rows = np.hstack(chunks)
        buckets[b] = []
        valid += rows.shape[1]
        rows = rows[:, np.lexsort(rows[::-1])]
        new = np.ones(rows.shape[1], dtype=np.bool_)
        new[1:] = (rows[:, 1:] != rows[:, :-1]).any(axis=0)
        _, keys, _ = lookup.find(0, rows[0][new])
        distinct_by_pid += np.bincount(pids_of(keys, partitions), minlength=partitions)
    duplicate = valid - int(distinct_by_pid.sum())
    return Produced(produced, spurious, duplicate, [int(n) for n in distinct_by_pid])


def judge(
    inputs: Sequence[Sequence[PartitionLog]],
    produced: Iterable[npt.NDArray[np.int64] | None],
    late_reported: Sequence[I64],
    *,
    window_ms: int,
    lateness_ms: int,
    partitions: int,
    malformed: int = 0,
    late_unknown: int = 0,
    say: Callable[[str], None] = _quiet,
) -> VerifyReport:
    """The report for input partitions `inputs[j]` of stream j, produced result ids `produced` (see
    `check_produced`) and the ids dead-lettered as late per stream (`late_unknown`: late dead letters
    naming no configured stream, or no id)."""
    streams = [stream_input(logs, lateness_ms) for logs in inputs]
    parts = [s.on_time for s in streams]
    say(f"counting the expected join of {sum(len(p) for p in parts):,} on-time tuples")
    expected = count_expected(parts, window_ms, partitions)
    say("checking each produced result as it is read")
    got = check_produced(parts, produced, window_ms, partitions)
    wrongly_late, unreported = late_unknown, 0
    for s, reported in zip(streams, late_reported, strict=True):
        said = np.unique(reported)
        wrongly_late += len(np.setdiff1d(said, s.late_ids, assume_unique=False))
        unreported += int(np.count_nonzero(~np.isin(s.late_ids, said)))
    missing_by_pid = {
        p: e - g for p, (e, g) in enumerate(zip(expected.by_pid, got.distinct_by_pid, strict=True)) if e != g
    }
    return VerifyReport(
        input_tuples=sum(s.tuples for s in streams),
        progress_records=sum(s.progress_records for s in streams),
        malformed=malformed,
        duplicate_input_ids=sum(s.duplicate_ids for s in streams),
        late_expected=sum(len(s.late_ids) for s in streams),
        late_reported=sum(len(r) for r in late_reported) + late_unknown,
        wrongly_late=wrongly_late,
        late_unreported=unreported,
        expected=expected.total,
        produced=got.produced,
        missing=expected.total - sum(got.distinct_by_pid),
        duplicate=got.duplicate,
        spurious=got.spurious,
        missing_by_pid=missing_by_pid,
    )


# --- records to arrays ---

Message = tuple[int, int, bytes | None]  # (partition, offset, value)


def partition_logs(messages: Iterable[Message], partitions: int) -> tuple[list[PartitionLog], int]:
    """An input topic's messages (partitions possibly interleaved) as one log per partition in offset
    order, and the number of malformed records, which the instances dead-letter whole: not decodable
    (a tombstone included), or holding a key whose pid is not its partition or a negative id."""
    records: dict[int, list[tuple[int, I64, I64 | None, I64 | None]]] = {}
    malformed = 0
    for partition, offset, value in messages:
        try:
            at = progress_of(value)
            if at is not None:
                records.setdefault(partition, []).append((offset, np.array([at], np.int64), None, None))
                continue
            if value is None:
                raise MalformedRecord(Malformation.TRUNCATED, "no value")
            ids, keys, ts = decode_tuple_columns(value)
            if len(keys) and (pids_of(keys, partitions) != partition).any():
                raise MalformedRecord(Malformation.WRONG_PARTITION, "key of another pid")
            if len(ids) and (ids < 0).any():
                raise MalformedRecord(Malformation.NEGATIVE_ID, "a negative tuple id")
        except MalformedRecord:
            malformed += 1
            continue
        # Copies: the decoded columns are views that would keep the whole message (payload too) alive.
        records.setdefault(partition, []).append((offset, ts.copy(), ids.copy(), keys.copy()))
    logs = []
    for pid in sorted(records):
        recs = records.pop(pid)
        if any(a[0] > b[0] for a, b in itertools.pairwise(recs)):
            recs.sort(key=lambda r: r[0])
        tuples = [r for r in recs if r[2] is not None]
        logs.append(
            PartitionLog(
                pid=pid,
                times=np.concatenate([r[1] for r in recs]),
                is_tuple=np.concatenate([np.full(len(r[1]), r[2] is not None) for r in recs]),
                ids=np.concatenate([r[2] for r in tuples if r[2] is not None] or [np.empty(0, np.int64)]),
                keys=np.concatenate([r[3] for r in tuples if r[3] is not None] or [np.empty(0, np.int64)]),
            )
        )
    return logs, malformed


def late_reports(values: Iterable[bytes | None], streams: Sequence[str]) -> tuple[list[I64], int]:
    """The ids of the dead-letter topic's late records, per stream; and how many late records name no
    configured stream or no id. Other records (malformed input, anything undecodable) are skipped."""
    index = {s: j for j, s in enumerate(streams)}
    ids: list[list[int]] = [[] for _ in streams]
    unknown = 0
    for value in values:
        try:
            record = json.loads(value) if value is not None else None
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        reason = record.get("reason")
        if not (isinstance(reason, str) and reason.startswith("late")):
            continue
        stream = record.get("stream")
        j = index.get(stream) if isinstance(stream, str) else None
        try:
            i = int(record["id"])
        except (KeyError, TypeError, ValueError):
            j = None
        if j is None or not -(2**63) <= i < 2**63:
            unknown += 1
        else:
            ids[j].append(i)
    return [np.array(x, dtype=np.int64) for x in ids], unknown


def result_ids(values: Iterable[bytes | None]) -> Iterator[npt.NDArray[np.int64] | None]:
    """The (m, n) id arrays of the results topic's records; None for a record that does not decode."""
    for value in values:
        if value is None:
            yield None
            continue
        try:
            yield decode_results(value).ids
        except MalformedRecord:
            yield None


# --- Kafka ---


def check_topics(cfg: Config, bootstrap: str) -> None:
    """Refuse to judge topics that are missing or whose partition count is not the configured one
    (partition index is the pid: with another count the rule and the pids mean something else)."""
    check_reachable(bootstrap)
    topics = admin_client(bootstrap).list_topics(timeout=DEFAULT_TIMEOUT_S).topics
    for name in [*cfg.input_topics, cfg.results_topic, cfg.dead_letter_topic]:
        meta = topics.get(name)
        if meta is None or meta.error is not None:
            raise TopicError(
                f"topic {name} does not exist at {bootstrap}: nothing to verify "
                f"(is the pipeline name {cfg.pipeline!r} right?)"
            )
        if name != cfg.dead_letter_topic and len(meta.partitions) != cfg.partitions:
            raise TopicError(
                f"topic {name} has {len(meta.partitions)} partitions but the configuration says "
                f"{cfg.partitions} (partition index is the pid): verify with the pipeline's own configuration"
            )


def read_inputs(
    cfg: Config, bootstrap: str, say: Callable[[str], None] = _quiet
) -> tuple[list[list[PartitionLog]], int]:
    """The partition logs of each configured stream's input topic, and the malformed records of all:
    what `judge` takes as the input, whichever engine's results it judges."""
    inputs, malformed = [], 0
    for s in cfg.streams:
        say(f"reading {cfg.input_topic(s)}")
        logs, bad = partition_logs(read_records(bootstrap, cfg.input_topic(s)), cfg.partitions)
        inputs.append(logs)
        malformed += bad
    return inputs, malformed


def verify_pipeline(
    cfg: Config, bootstrap: str, progress: Callable[[str], None] | None = None
) -> VerifyReport:
    say = progress or _quiet
    check_topics(cfg, bootstrap)
    inputs, malformed = read_inputs(cfg, bootstrap, say)
    say(f"reading {cfg.dead_letter_topic}")
    reported, unknown = late_reports(
        (v for _, _, v in read_records(bootstrap, cfg.dead_letter_topic)), cfg.streams
    )
    return judge(
        inputs,
        result_ids(v for _, _, v in read_records(bootstrap, cfg.results_topic)),
        reported,
        window_ms=cfg.window_ms,
        lateness_ms=cfg.allowed_lateness_ms,
        partitions=cfg.partitions,
        malformed=malformed,
        late_unknown=unknown,
        say=say,
    )
