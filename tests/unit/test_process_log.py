"""The log of the pipeline's processes (`pipeline.process_log`): their lines on stdout, where the local
runtime and the tests read them, and without it a module's warnings still on stderr."""

from __future__ import annotations

import subprocess
import sys

LINES = """
import logging
from pipeline.instance import log
from pipeline.topics import KAFKA_LOG
log.info("%s: running (incarnation %s), checkpoint %s", "instance-0", "abc", "/work/x")
log.error("%s: Spark's JVM is gone (%s), exiting", "instance-0", "Py4JError")
KAFKA_LOG.error("connection refused")
logging.getLogger("py4j.clientserver").info("Closing down clientserver connection")
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def test_a_configured_process_logs_its_lines_on_stdout_with_time_level_and_logger() -> None:
    done = _run("from pipeline.process_log import configure_logging\nconfigure_logging()\n" + LINES)
    lines = done.stdout.splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "INFO pipeline.instance: instance-0: running (incarnation abc), checkpoint /work/x",
        "ERROR pipeline.instance: instance-0: Spark's JVM is gone (Py4JError), exiting",
    ], "librdkafka's and py4j's lines stay out"
    assert done.stderr == ""


def test_without_configuration_warnings_and_errors_reach_stderr() -> None:
    """Spark's Python workers import the modules and configure nothing: no crash, no lost error."""
    done = _run(LINES)
    assert done.stdout == ""
    assert done.stderr.splitlines() == ["instance-0: Spark's JVM is gone (Py4JError), exiting"]
