"""Where each micro-batch's time goes: Spark's own phases (its progress's `durationMs`) and the sink's,
one JSON line per batch in `batch_timings.jsonl` beside the checkpoint, when `instance.batch_timings`
is on.

A diagnosis aid, off by default (a line per batch is about 50 MB a day at two batches a second): the
latency benchmark turns it on and reports what its slowest batches spent their time on
(`slowest_breakdown`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SINK_PHASES = ("collect", "prepare", "produce", "commit", "notes")
"""The sink's phases, in order: `collect` runs the batch (the source's reads, the join's tasks, the
state stores' loads and commits; `toArrow`), `prepare` reads the offset log and each result's event
time and asks the broker for the input's lag, `produce` writes the output, the commit marker and the
metrics record in the transaction, `commit` commits it, `notes` writes the files the source reads."""

SPARK_PHASES = ("latestOffset", "getBatch", "queryPlanning", "walCommit", "commitOffsets")
"""Spark's phases outside the sink (`addBatch` is the sink's call; `triggerExecution` the whole)."""


@dataclass(slots=True)
class BatchTimingsLog:
    """Appends a line per batch once both Spark's progress and the sink's phases have it."""

    path: Path
    written: int = -1

    def observe(
        self, progress: Iterable[Mapping[str, Any]], phases: Mapping[int, Mapping[str, float]]
    ) -> None:
        lines = []
        for p in progress:
            batch = int(p["batchId"])
            if batch <= self.written or batch not in phases:
                continue
            lines.append(
                json.dumps(
                    {
                        "batch": batch,
                        "timestamp": p["timestamp"],
                        "input_rows": p["numInputRows"],
                        "spark_ms": dict(p["durationMs"]),
                        "sink_s": dict(phases[batch]),
                    }
                )
            )
            self.written = batch
        if lines:
            with self.path.open("a") as f:
                f.write("\n".join(lines) + "\n")


def read_batch_timings(path: Path) -> list[dict[str, Any]]:
    """The lines `BatchTimingsLog` wrote; none when it never wrote."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    except FileNotFoundError:
        return []


def breakdown(row: Mapping[str, Any]) -> dict[str, float]:
    """One batch's seconds per phase, adding up to its whole (`total`): Spark's phases, the sink's,
    and what neither names (`other`: Spark's own work between them)."""
    spark, sink = row["spark_ms"], row["sink_s"]
    out = {name: spark.get(name, 0) / 1000 for name in SPARK_PHASES}
    out |= {name: sink.get(name, 0.0) for name in SINK_PHASES}
    total = spark["triggerExecution"] / 1000
    out["other"] = max(0.0, total - sum(out.values()))
    out["total"] = total
    return out


def slowest_breakdown(rows: Sequence[Mapping[str, Any]], share: float = 0.01) -> dict[str, float]:
    """The mean breakdown of the slowest `share` of the batches (at least one); empty without rows."""
    if not rows:
        return {}
    ranked = sorted((breakdown(r) for r in rows), key=lambda b: b["total"], reverse=True)
    slowest = ranked[: max(1, math.ceil(share * len(ranked)))]
    return {k: round(sum(b[k] for b in slowest) / len(slowest), 3) for k in slowest[0]}
