"""A fluxjoin process's log: one line per record on stdout, with its time, level and logger.

The commands that run the pipeline's processes (`fluxjoin instance`, `fluxjoin generate`, `fluxjoin
controller`) call `configure_logging` once, at their start: their stdout is where the local runtime
(`local/processes.py`, which writes it to `<name>.log`), the tests and a pod's log read them. The modules
only log, each to `logging.getLogger(__name__)`, and configure nothing: a process that imports them
without configuring logging (a benchmark, `fluxjoin verify`, Spark's Python workers) still shows their
warnings and errors on stderr, through logging's last resort.
"""

from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SILENT = ("py4j", "fluxjoin.kafka")
"""Loggers kept out of the process's log, silent as they are where no logging is configured (their
libraries give each a `NullHandler`): py4j's, which says at INFO how each of the query's callback
connections opens and closes, and librdkafka's (`pipeline.topics.KAFKA_LOG`), which repeats a refused
connection for as long as a broker is down."""


def configure_logging() -> None:
    """Log records at INFO and above to stdout (`LOG_FORMAT`); once, at the process's start."""
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format=LOG_FORMAT)
    for name in SILENT:
        silent = logging.getLogger(name)
        silent.addHandler(logging.NullHandler())
        silent.propagate = False
