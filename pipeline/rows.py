"""The rows the source hands the operator: their schema, the codes the `stream` column holds besides a
data row's stream index, and the builder of one pid's rows.

Rows: (pid, stream, id, key, ts). A record that does not decode becomes one row with stream = -1,
id = its Kafka offset, key = the stream index, ts = the `Malformation` code, so it reaches the
dead-letter topic through the same exactly-once sink instead of failing the query or vanishing.

Apart from the source because the operator (`pipeline/operator.py`) and the sink read the same codes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.config import MAX_STREAMS

SOURCE_SCHEMA = "pid int, stream short, id long, key long, ts long"
ARROW_SCHEMA = pa.schema(
    [("pid", pa.int32()), ("stream", pa.int16()), ("id", pa.int64()), ("key", pa.int64()), ("ts", pa.int64())]
)
CODE = np.int16
"""The `stream` column's type: wide enough for a code per stream of every generation of a spilled pid."""
# Values of the `stream` column besides 0..m-1 (data rows):
MALFORMED_STREAM = -1  # id = Kafka offset, key = stream index, ts = Malformation code
RELEASE_ROW = -2  # the pid leaves this instance; key = 1 to export its window
WATERMARK_ROW = -3  # id = stream index j, ts = stream_max[j] of an installed snapshot or a resumed track
# TRACK_ROW: a parallel track begins; key = TRACK_OLD (sender) or TRACK_NEW (receiver: one row per stream,
# id = j, ts = the sender's stream_max[j])
TRACK_ROW = -4
TRACK_OLD, TRACK_NEW = 1, 2
DROP_ROW = -5  # the window this instance still holds for the pid is stale: dropped before anything else
SPILL_ROW = -6  # the window leaves memory (its `stream_max` stays): new tuples start a new generation
WINDOW_ROW = 16  # WINDOW_ROW + j: a window tuple of stream j to install, not to join
SILENT_ROW = 32  # SILENT_ROW + j: a tuple of stream j a dead instance processed: processed again, silently
CROSS_ROW = 48  # cross_row(g, j): a tuple of stream j of a spilled pid's generation g + 1, re-read at
# clean-up: joined with generations 0..g only (`pipeline.spill`)
MAX_SPILLS = (np.iinfo(CODE).max + 1 - CROSS_ROW) // MAX_STREAMS
"""The spill points one pid may hold before its clean-up (4,090): every generation after the first needs
codes of its own in the `stream` column."""


def cross_row(generation: int, stream: int) -> int:
    """The `stream` code of stream `stream`'s tuples of generation `generation + 1`, at clean-up."""
    return CROSS_ROW + MAX_STREAMS * generation + stream


def pid_rows(pid: int, stream: Any, ids: Any, keys: Any, ts: Any) -> pa.RecordBatch:
    """One pid's rows, as an Arrow batch of `ARROW_SCHEMA`."""
    n = len(stream)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(n, pid, dtype=np.int32)),
            pa.array(np.asarray(stream, dtype=CODE)),
            pa.array(np.asarray(ids, dtype=np.int64)),
            pa.array(np.asarray(keys, dtype=np.int64)),
            pa.array(np.asarray(ts, dtype=np.int64)),
        ],
        schema=ARROW_SCHEMA,
    )
