"""The Flink baseline's pure parts: the job's command line, its timing markers, and the latency
percentiles read from a results topic."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.peers import MAIN_CLASS, FlinkJob, alternated, latency_percentiles, markers


def _job(bounded: bool) -> FlinkJob:
    return FlinkJob(
        "localhost:9092",
        ("run.in.A", "run.in.B"),
        "run.flink-results",
        window_ms=10_000,
        lateness_ms=2_000,
        bounded=bounded,
        checkpoint_dir=Path("work/ckpt"),
        txn_prefix="run-flink",
    )


def test_command_runs_the_job_class_with_every_setting_as_a_flag() -> None:
    cmd = _job(bounded=True).command("/usr/bin/java", [Path("/c/a.jar"), Path("/c/b.jar")])
    assert cmd[0] == "/usr/bin/java"
    assert cmd[cmd.index("-cp") + 1] == "/c/a.jar:/c/b.jar"
    flags = cmd[cmd.index(MAIN_CLASS) + 1 :]
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert given["--left"] == "run.in.A" and given["--right"] == "run.in.B"
    assert given["--results"] == "run.flink-results"
    assert given["--window-ms"] == "10000" and given["--lateness-ms"] == "2000"
    assert given["--bounded"] == "true", "Java's Boolean.parseBoolean reads only true/false"
    assert given["--parallelism"] == "2"
    assert Path(given["--checkpoint-dir"]).is_absolute(), "a file:// URI needs an absolute path"
    assert _job(bounded=False).command("java", [])[-len(flags) :][flags.index("--bounded") + 1] == "false"


def test_a_rescaling_job_gets_its_signal_and_savepoint_flags() -> None:
    plain = _job(bounded=False).command("java", [])
    assert "--rescale-to" not in plain, "a job that does not rescale has no rescale flags"
    cmd = _job(bounded=False).rescaled(3, Path("work/rescale"), Path("work")).command("java", [])
    flags = cmd[cmd.index(MAIN_CLASS) + 1 :]
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    assert given["--parallelism"] == "2" and given["--rescale-to"] == "3"
    assert Path(given["--rescale-signal"]).is_absolute() and Path(given["--savepoint-dir"]).is_absolute()


def test_markers_are_read_among_other_output() -> None:
    lines = [
        "SLF4J: Defaulting to no-operation (NOP) logger implementation",
        "running-ms 1795947595096",
        "first-record-ms 1795947596329",
        "done-ms 1795947599041",
        "done-ms not a number",
    ]
    assert markers(lines) == {
        "running": 1795947595096,
        "first-record": 1795947596329,
        "done": 1795947599041,
    }


def test_latency_is_read_time_minus_max_event_time_after_the_warm_up() -> None:
    start_ms = 1_000_000
    seen = [
        (1000.0 + 9.0, np.array([start_ms, start_ms + 1000])),  # warm-up: read 9 s and 8 s late
        (1000.0 + 21.5, np.array([start_ms + 20_000, start_ms + 21_000])),  # 1.5 s and 0.5 s
        (1000.0 + 31.0, np.array([start_ms + 30_000])),  # 1.0 s
    ]
    p50, p99, n = latency_percentiles(seen, warm_up_s=15)
    assert n == 3
    assert p50 == 1.0
    assert p99 is not None and 1.4 < p99 <= 1.5
    assert latency_percentiles(seen, warm_up_s=60) == (None, None, 0)
    assert latency_percentiles([]) == (None, None, 0)


def test_the_engines_take_turns_going_first() -> None:
    engines = ("fluxjoin", "flink")
    assert [alternated(engines, i)[0] for i in range(4)] == ["fluxjoin", "flink", "fluxjoin", "flink"]
    assert sorted(alternated(engines, 1)) == sorted(engines), "every engine runs in every repeat"
