"""The oracle: the exact join computed offline from the input topics, compared with the results topic.

"No loss, no duplicates" means the multiset of produced results equals the multiset of expected ones.
Tuples the instances reported as late (dead-letter topic) are excluded from the expected join, since
the pipeline's contract is to report them instead of joining them; they are counted in the report.

Memory stays bounded in two ways. The check runs one bucket of stream 0's ids at a time
(`VERIFY_BUCKETS`): the expected results of a bucket are the join of that bucket's stream-0 tuples
with the other streams, and only the produced ids are held for the whole check. Within a bucket the
join runs in event-time chunks of stream 0: a combination's stream-0 part lies in exactly one chunk,
and its other parts within W of it, so each combination is found exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipeline.codec import MalformedRecord, decode_results, decode_tuple_columns
from pipeline.config import Config
from pipeline.join import Part, Results, join_parts
from pipeline.partitioning import pids_of
from pipeline.topics import read_topic

CHUNK_TUPLES = 250_000


@dataclass(frozen=True)
class VerifyReport:
    input_tuples: int
    late: int
    malformed: int
    expected: int
    produced: int
    missing: int
    duplicate: int
    spurious: int
    missing_by_pid: dict[int, int] = field(default_factory=dict)
    """Where missing results belong (pid of their key): a loss is traced to the moves of that pid."""

    @property
    def exact(self) -> bool:
        return self.missing == 0 and self.duplicate == 0 and self.spurious == 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"exact": self.exact}

    def describe(self) -> str:
        verdict = "EXACT" if self.exact else "NOT EXACT"
        return (
            f"input tuples {self.input_tuples:,} (late {self.late:,}, malformed records {self.malformed:,})\n"
            f"expected {self.expected:,}  produced {self.produced:,}  missing {self.missing:,}  "
            f"duplicate {self.duplicate:,}  spurious {self.spurious:,}  -> {verdict}"
            + (f"\nmissing by pid {self.missing_by_pid}" if self.missing_by_pid else "")
        )


def read_stream(bootstrap: str, topic: str) -> tuple[Part, int]:
    """All well-formed tuples of an input topic, and the number of malformed records skipped."""
    ids, keys, ts = [], [], []
    malformed = 0
    for _, _, value in read_topic(bootstrap, topic):
        try:
            i, k, t = decode_tuple_columns(value)
        except MalformedRecord:
            malformed += 1
            continue
        ids.append(i)
        keys.append(k)
        ts.append(t)
    if not ids:
        return Part.empty(), malformed
    return Part(np.concatenate(ids), np.concatenate(keys), np.concatenate(ts)), malformed


def read_late(bootstrap: str, cfg: Config) -> dict[str, set[int]]:
    late: dict[str, set[int]] = {s: set() for s in cfg.streams}
    for _, _, value in read_topic(bootstrap, cfg.dead_letter_topic):
        record = json.loads(value)
        if record.get("reason", "").startswith("late"):
            late[record["stream"]].add(int(record["id"]))
    return late


def expected_join(parts: list[Part], window_ms: int, chunk: int = CHUNK_TUPLES) -> Results:
    """The exact m-way window join of whole streams, in event-time chunks of stream 0."""
    ordered = []
    for p in parts:
        o = np.argsort(p.ts, kind="stable")
        ordered.append(Part(p.ids[o], p.keys[o], p.ts[o]))
    first, others = ordered[0], ordered[1:]
    found: list[Results] = []
    for lo in range(0, len(first), chunk):
        head = Part(first.ids[lo : lo + chunk], first.keys[lo : lo + chunk], first.ts[lo : lo + chunk])
        t_lo, t_hi = int(head.ts[0]) - window_ms, int(head.ts[-1]) + window_ms
        window_parts = [head]
        for p in others:
            a, b = np.searchsorted(p.ts, t_lo, "left"), np.searchsorted(p.ts, t_hi, "right")
            window_parts.append(Part(p.ids[a:b], p.keys[a:b], p.ts[a:b]))
        r = join_parts(window_parts, window_ms)
        if len(r):
            found.append(r)
    m = len(parts)
    if not found:
        return Results(np.empty((m, 0), np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    return Results(
        np.hstack([r.ids for r in found]),
        np.concatenate([r.keys for r in found]),
        np.concatenate([r.max_ts for r in found]),
    )


VERIFY_BUCKETS = 16
"""Buckets of stream 0's ids, checked one after the other. Holding the whole expected join and counting
it at once took 248 bytes per result: 14.3 GB for 58 million. Ids, unlike pids, spread evenly
whatever the skew of the keys."""


def bucket_of(first_ids: np.ndarray) -> np.ndarray:
    return (first_ids % VERIFY_BUCKETS).astype(np.uint8)


def split_results(batches: Iterable[np.ndarray], m: int) -> list[np.ndarray]:
    """The produced (m, n) id rows, one array per bucket of their stream-0 id; copied, so that the
    decoded buffers (which also hold keys and event times) are freed as the topic is read."""
    chunks: list[list[np.ndarray]] = [[] for _ in range(VERIFY_BUCKETS)]
    for ids in batches:
        buckets = bucket_of(ids[0])
        for b in np.unique(buckets):
            chunks[b].append(ids[:, buckets == b])
    return [np.hstack(c) if c else np.empty((m, 0), np.int64) for c in chunks]


def compare(expected: np.ndarray, produced: np.ndarray) -> tuple[int, int, int]:
    """(missing, duplicate, spurious) between two multisets of id rows, given as (m, n) arrays."""
    cols = [f"id{j}" for j in range(expected.shape[0])]
    e = pd.DataFrame(expected.T, columns=cols).value_counts().rename("e")
    p = pd.DataFrame(produced.T, columns=cols).value_counts().rename("p")
    both = pd.concat([e, p], axis=1).fillna(0)
    ce, cp = both["e"].to_numpy(), both["p"].to_numpy()
    missing = int(np.clip(ce - cp, 0, None).sum())
    duplicate = int(np.where(ce > 0, np.clip(cp - ce, 0, None), 0).sum())
    spurious = int(np.where(ce == 0, cp, 0).sum())
    return missing, duplicate, spurious


def missing_by_pid(expected: Results, produced: np.ndarray, partitions: int) -> dict[int, int]:
    """How many expected results are absent from `produced`, by the pid of their key."""
    cols = [f"id{j}" for j in range(expected.ids.shape[0])]
    got = pd.DataFrame(produced.T, columns=cols).drop_duplicates()
    want = pd.DataFrame(expected.ids.T, columns=cols).assign(pid=pids_of(expected.keys, partitions))
    gone = want.merge(got, on=cols, how="left", indicator=True).query("_merge == 'left_only'")
    return {int(pid): int(n) for pid, n in sorted(gone["pid"].value_counts().items())}


@dataclass(frozen=True)
class Comparison:
    expected: int
    missing: int
    duplicate: int
    spurious: int
    missing_by_pid: dict[int, int]


def check(
    parts: list[Part],
    produced: list[np.ndarray],
    window_ms: int,
    partitions: int,
    say: Callable[[str], None],
) -> Comparison:
    """The expected join of `parts` against the produced ids of `split_results`, bucket by bucket."""
    first, others = parts[0], parts[1:]
    in_bucket = bucket_of(first.ids)
    counts = np.zeros(4, np.int64)  # expected, missing, duplicate, spurious
    absent: Counter[int] = Counter()
    say(f"computing the exact join and comparing, in {VERIFY_BUCKETS} buckets of ids")
    # A chunk of one bucket's stream-0 tuples spans VERIFY_BUCKETS times the event time of as many tuples
    # of the whole stream, and the other streams' tuples a chunk is joined with grow with its span.
    chunk = max(1, CHUNK_TUPLES // VERIFY_BUCKETS)
    for b in range(VERIFY_BUCKETS):
        want = expected_join([first.take(in_bucket == b), *others], window_ms, chunk)
        missing, duplicate, spurious = compare(want.ids, produced[b])
        counts += (len(want), missing, duplicate, spurious)
        if missing:
            absent.update(missing_by_pid(want, produced[b], partitions))
    expected, missing, duplicate, spurious = (int(n) for n in counts)
    return Comparison(expected, missing, duplicate, spurious, dict(sorted(absent.items())))


def read_results(bootstrap: str, cfg: Config) -> list[np.ndarray]:
    batches = (decode_results(v).ids for _, _, v in read_topic(bootstrap, cfg.results_topic))
    return split_results(batches, len(cfg.streams))


def verify_pipeline(
    cfg: Config, bootstrap: str, progress: Callable[[str], None] | None = None
) -> VerifyReport:
    say = progress or (lambda _msg: None)
    parts, malformed, late_count = [], 0, 0
    late = read_late(bootstrap, cfg)
    for s in cfg.streams:
        say(f"reading {cfg.input_topic(s)}")
        part, bad = read_stream(bootstrap, cfg.input_topic(s))
        malformed += bad
        if late[s]:
            is_late = np.isin(part.ids, np.fromiter(late[s], dtype=np.int64))
            late_count += int(is_late.sum())
            part = part.take(~is_late)
        parts.append(part)
    say(f"reading {cfg.results_topic}")
    produced = read_results(bootstrap, cfg)
    c = check(parts, produced, cfg.window_ms, cfg.partitions, say)
    return VerifyReport(
        input_tuples=sum(len(p) for p in parts) + late_count,
        late=late_count,
        malformed=malformed,
        expected=c.expected,
        produced=sum(p.shape[1] for p in produced),
        missing=c.missing,
        duplicate=c.duplicate,
        spurious=c.spurious,
        missing_by_pid=c.missing_by_pid,
    )
