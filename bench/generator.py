"""Generator throughput benchmark: max-rate producing on one core, against a real broker.

Measures what the design requires (>= 200K tuples/s from one core) end to end: topic metadata,
tuple generation, encoding, librdkafka, and the final flush until every message is acknowledged
(acks=all). Pinning the process to one CPU before the producer starts pins librdkafka's threads
too (threads inherit the affinity mask), so "one core" includes the client's background work.

Run: `python -m bench.generator --bootstrap localhost:9092` (prints one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from generator.producer import run_generator
from pipeline.config import Config, load_config
from pipeline.topics import delete_topics, topic_specs

TARGET_TUPLES_PER_S = 200_000


@contextmanager
def _pinned(cpu: int | None) -> Iterator[None]:
    """Run the body with this thread (and threads it starts) on one CPU; restore afterwards."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def bench_config(
    pipeline: str, tuples: int, tuples_per_message: int, payload_bytes: int, partitions: int
) -> Config:
    """A max-rate run of exactly `tuples` tuples over 3 streams with uniform keys.

    The event-time rate (100K/s per stream) only sets how many tuples a chunk holds (enough to fill
    messages of every pid); it does not limit the speed of a max-rate run.
    """
    return load_config(
        None,
        [
            f"pipeline={pipeline}",
            f"partitions={partitions}",
            "instances=1",
            "generator.mode=max_rate",
            "generator.duration_s=null",
            f"generator.max_tuples={tuples}",
            f"generator.tuples_per_message={tuples_per_message}",
            f"generator.payload_bytes={payload_bytes}",
            "generator.rate={kind: constant, rate: 100000}",
        ],
    )


def run_generator_bench(
    bootstrap: str,
    tuples: int = 2_000_000,
    tuples_per_message: Sequence[int] = (64, 256, 1024),
    runs: int = 3,
    payload_bytes: int = 16,
    partitions: int = 64,
    cpu: int | None = 0,
    producer_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Median of `runs` max-rate runs per tuples_per_message value, pinned to `cpu` (None: unpinned)."""
    pipeline = f"bench-gen-{uuid.uuid4().hex[:8]}"
    results: list[dict[str, Any]] = []
    try:
        for tpm in tuples_per_message:
            cfg = bench_config(pipeline, tuples, tpm, payload_bytes, partitions)
            if not results:
                # Warm-up, not recorded: the broker's first writes to fresh partitions (JIT, segment
                # files) are several times slower than steady state.
                with _pinned(cpu):
                    warm = bench_config(pipeline, max(1, tuples // 2), tpm, payload_bytes, partitions)
                    run_generator(warm, bootstrap, producer_overrides=producer_overrides)
            samples = []
            for _ in range(runs):
                cpu_before = time.process_time()
                with _pinned(cpu):
                    stats = run_generator(cfg, bootstrap, producer_overrides=producer_overrides)
                cpu_s = time.process_time() - cpu_before
                samples.append(
                    {
                        "tuples_per_s": stats["tuples_per_s"],
                        "mb_per_s": round(stats["bytes"] / stats["seconds"] / 1e6, 2),
                        "seconds": stats["seconds"],
                        # CPU time of this process, librdkafka's threads included: the generator's
                        # own cost, independent of how fast the broker acknowledges.
                        "tuples_per_cpu_s": round(stats["tuples"] / cpu_s, 1) if cpu_s > 0 else None,
                        "messages": stats["messages"],
                    }
                )
            results.append(
                {
                    "tuples_per_message": tpm,
                    "tuples_per_s": statistics.median(s["tuples_per_s"] for s in samples),
                    "mb_per_s": statistics.median(s["mb_per_s"] for s in samples),
                    "tuples_per_cpu_s": statistics.median(s["tuples_per_cpu_s"] or 0.0 for s in samples),
                    "messages": samples[0]["messages"],
                    "runs": samples,
                }
            )
    finally:
        _delete_topics(bootstrap, pipeline, partitions)
    best = max(r["tuples_per_s"] for r in results)
    return {
        "tuples": tuples,
        "payload_bytes": payload_bytes,
        "partitions": partitions,
        "cpu": cpu,
        "runs": runs,
        "results": results,
        "target_tuples_per_s": TARGET_TUPLES_PER_S,
        "meets_target": best >= TARGET_TUPLES_PER_S,
    }


def _delete_topics(bootstrap: str, pipeline: str, partitions: int) -> None:
    """Drop the benchmark's topics so repeated runs do not pile up data on the broker."""
    delete_topics(bootstrap, [s.name for s in topic_specs(bench_config(pipeline, 1, 1, 0, partitions))])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--tuples", type=int, default=2_000_000)
    parser.add_argument("--tuples-per-message", default="64,256,1024", help="comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--payload-bytes", type=int, default=16)
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--cpu", type=int, default=0, help="CPU to pin to; -1 for no pinning")
    parser.add_argument("--set", action="append", default=[], help="producer config key=value")
    args = parser.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    report = run_generator_bench(
        args.bootstrap,
        tuples=args.tuples,
        tuples_per_message=[int(x) for x in args.tuples_per_message.split(",")],
        runs=args.runs,
        payload_bytes=args.payload_bytes,
        partitions=args.partitions,
        cpu=None if args.cpu < 0 else args.cpu,
        producer_overrides=overrides,
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
