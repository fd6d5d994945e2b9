"""The source's reads of pid ranges on a real broker."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from confluent_kafka import Producer

from pipeline.codec import encode_tuples
from pipeline.config import load_config
from pipeline.partitioning import pids_of
from pipeline.source import SILENT_ROW, WINDOW_ROW, PidRange, read_ranges
from pipeline.topics import ensure_topics

PARTITIONS = 4


def test_back_to_back_ranges_of_one_partition_are_each_read_whole(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """A parallel track's side recovered on a third instance re-reads the window before the cutoff and,
    silently, the input after it, in one batch: two ranges of the same partition. Each must come back
    with every one of its tuples (the second once replaced the first, and the window came back empty)."""
    cfg = load_config(None, [f"pipeline={topic_prefix}", "streams=[A, B]", f"partitions={PARTITIONS}"])
    ensure_topics(cfg, kafka_bootstrap)
    topic = cfg.input_topic("A")
    keys = np.array([k for k in range(2000) if pids_of([k], PARTITIONS)[0] == 1][:30], dtype=np.int64)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, key in enumerate(keys):  # one tuple per message: offset i holds tuple id i
        one = np.array([i], dtype=np.int64)
        producer.produce(
            topic, encode_tuples(one, np.array([key]), one, np.zeros((1, 0), np.uint8)), partition=1
        )
    assert producer.flush(30) == 0

    window = PidRange(0, topic, 1, 2, 12, window=True)
    silent = PidRange(0, topic, 1, 12, 20, silent=True)
    later = PidRange(0, topic, 1, 25, 28)  # after a gap: offsets 20-24 belong to no range
    batches = list(read_ranges(kafka_bootstrap, [silent, later, window], PARTITIONS))

    table = pa.Table.from_batches(batches).to_pandas()
    by_code = {int(code): sorted(rows["id"].tolist()) for code, rows in table.groupby("stream")}
    assert by_code == {
        WINDOW_ROW: list(range(2, 12)),
        SILENT_ROW: list(range(12, 20)),
        0: list(range(25, 28)),
    }
    assert set(table["pid"]) == {1}
