"""The oracle: the exact join computed offline from the input topics, compared with the results topic.

"No loss, no duplicates" means the multiset of produced results equals the multiset of expected ones.
Tuples the instances reported as late (dead-letter topic) are excluded from the expected join, since
the pipeline's contract is to report them instead of joining them; they are counted in the report.

Memory stays bounded by joining in event-time chunks of stream 0: a combination's stream-0 part lies
in exactly one chunk, and its other parts within W of it, so each combination is found exactly once.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
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


COMPARE_BUCKETS = 8


def _buckets(expected: np.ndarray, produced: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Boolean masks of both sides' (m, n) id rows, one pair per bucket of the first id: equal rows
    share a bucket, so multisets compare bucket by bucket. Counting rows with pandas takes over 100
    bytes per result, and at once for about 160 million results it ran a 24 GB machine out of memory."""
    e_bucket = (expected[0] % COMPARE_BUCKETS).astype(np.uint8)
    p_bucket = (produced[0] % COMPARE_BUCKETS).astype(np.uint8)
    for bucket in range(COMPARE_BUCKETS):
        yield e_bucket == bucket, p_bucket == bucket


def compare(expected: np.ndarray, produced: np.ndarray) -> tuple[int, int, int]:
    """(missing, duplicate, spurious) between two multisets of id rows, given as (m, n) arrays."""
    totals = np.zeros(3, np.int64)
    for e, p in _buckets(expected, produced):
        totals += _compare_bucket(expected[:, e], produced[:, p])
    missing, duplicate, spurious = (int(n) for n in totals)
    return missing, duplicate, spurious


def _compare_bucket(expected: np.ndarray, produced: np.ndarray) -> tuple[int, int, int]:
    m = expected.shape[0]
    cols = [f"id{j}" for j in range(m)]
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
    absent: Counter[int] = Counter()
    for e, p in _buckets(expected.ids, produced):
        got = pd.DataFrame(produced[:, p].T, columns=cols).drop_duplicates()
        want = pd.DataFrame(expected.ids[:, e].T, columns=cols).assign(
            pid=pids_of(expected.keys[e], partitions)
        )
        gone = want.merge(got, on=cols, how="left", indicator=True).query("_merge == 'left_only'")
        absent.update({int(pid): int(n) for pid, n in gone["pid"].value_counts().items()})
    return dict(sorted(absent.items()))


def read_results(bootstrap: str, cfg: Config) -> np.ndarray:
    chunks = [decode_results(v).ids for _, _, v in read_topic(bootstrap, cfg.results_topic)]
    m = len(cfg.streams)
    return np.hstack(chunks) if chunks else np.empty((m, 0), dtype=np.int64)


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
    say("computing the exact join")
    expected = expected_join(parts, cfg.window_ms)
    say(f"reading {cfg.results_topic}")
    produced = read_results(bootstrap, cfg)
    missing, duplicate, spurious = compare(expected.ids, produced)
    return VerifyReport(
        input_tuples=sum(len(p) for p in parts) + late_count,
        late=late_count,
        malformed=malformed,
        expected=expected.ids.shape[1],
        produced=produced.shape[1],
        missing=missing,
        duplicate=duplicate,
        spurious=spurious,
        missing_by_pid=missing_by_pid(expected, produced, cfg.partitions) if missing else {},
    )
