"""The local runtime: instance and generator processes on this machine, and what they report.

Used by `fluxjoin demo`, the benchmarks and the integration tests, so all three run the pipeline the
same way a user does: each instance is a separate `fluxjoin instance` process (its own Spark
application), the generator a `fluxjoin generate` process, all sharing one configuration file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import yaml

from pipeline.config import Config
from pipeline.kafka_client import CONSUMER_GROUP, kafka_config
from pipeline.topics import consume_ready

if TYPE_CHECKING:
    from pipeline.control import ControlLog


class ProcessFailed(RuntimeError):
    """A process of the local pipeline exited with an error (an instance whose JVM ran out of heap,
    a controller refusing its options): no wait on the pipeline outlives it."""


def pid_spec(pids: range | list[int]) -> str:
    return ",".join(str(p) for p in pids)


def _reap(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for a signalled process; SIGKILL its group (an instance's JVM too) if it outlives the wait."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class LocalPipeline:
    """A pipeline's processes. `work` holds the config, logs and the instances' checkpoints."""

    cfg: Config
    bootstrap: str
    work: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)
    budgeted: set[str] = field(default_factory=set)
    """Names of the processes started in a cgroup of their own, removed in stop()."""

    def __post_init__(self) -> None:
        from pipeline.topics import ensure_topics

        ensure_topics(self.cfg, self.bootstrap)  # before any process starts: none races another for them
        self.work.mkdir(parents=True, exist_ok=True)
        self.cfg = self.cfg.with_overrides(bootstrap=self.bootstrap, **{"instance.work_dir": str(self.work)})
        self.config_path = self.work / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False))

    def _spawn(
        self,
        name: str,
        args: list[str],
        cpu_limit: float | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        from local.cpu_budget import budget_hook

        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        env = os.environ | {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        env |= extra_env or {}
        hook = None
        if cpu_limit:
            hook = budget_hook(f"{self.cfg.pipeline}-{name}", cpu_limit)
            self.budgeted.add(name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "fluxjoin", *args, "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C goes to the supervisor, which stops children in order
            preexec_fn=hook,
        )
        self.procs[name], self.logs[name] = proc, log
        return proc

    def start_instance(
        self,
        name: str,
        pids: range | list[int] | None = None,
        metrics_port: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start `name` on static `pids`, or (None) on what the controller assigns it. The instances of one
        machine cannot share a metrics port: without one of its own (`metrics_port`), an instance serves
        no /metrics, /healthz or /readyz. `env` adds to this process's environment for that instance
        alone (its JVM and Python workers inherit it): what sets one host apart from the others, such as
        a clock of its own (`tests/integration/test_clock.py`)."""
        static = ["--pids", pid_spec(pids)] if pids is not None else []
        args = ["instance", "--name", name, *static, "--metrics-port", str(metrics_port)]
        self._spawn(name, args, self.cfg.instance.cpu_limit, env)

    def start_generator(self) -> None:
        self._spawn("generator", ["generate"])

    def generator_summary(self) -> dict[str, Any] | None:
        """What the generator process printed last (`run_generator`'s summary), once it has ended."""
        lines = (self.work / "generator.log").read_text(errors="replace").splitlines()
        try:
            summary = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            return None
        return summary if isinstance(summary, dict) else None

    def end_input(self, timeout_s: float = 120) -> None:
        """Stop the generator early and cleanly (SIGTERM: it flushes what it produced, then exits 0)."""
        proc = self.procs["generator"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if proc.wait(timeout_s) != 0:
            raise RuntimeError(f"the generator failed:\n{self.log_tail('generator')}")

    def start_controller(
        self,
        policy: str | None = None,
        mode: str | None = None,
        heartbeat_timeout_s: float = 10,
        policy_params: dict[str, float] | None = None,
        name: str = "controller",
        decisions: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start a controller process as `name` (a second one under another name contends for the log),
        with the config's policy and handoff mode unless `policy` or `mode` say otherwise, recording its
        rounds' decisions to `decisions` if given (`fluxjoin controller --decisions`). `env` adds to this
        process's environment for the controller alone (its own credentials and key)."""
        args = ["--heartbeat-timeout", str(heartbeat_timeout_s)]
        args += ["--policy", policy] if policy else []
        args += ["--mode", mode] if mode else []
        for key, value in (policy_params or {}).items():
            args += ["--policy-param", f"{key}={value}"]
        if decisions is not None:
            args += ["--decisions", str(decisions)]
        self._spawn(name, ["controller", *args], extra_env=env)

    def set_cpu_limit(self, name: str, cores: float) -> None:
        """Change the CPU quota of `name`, started under one (`instance.cpu_limit`), while it runs: to
        the process it is as if another load on its machine took the rest (Flux's loaded machines)."""
        from local.cpu_budget import make_group

        if name not in self.budgeted:
            raise ValueError(f"{name} runs without a CPU quota (instance.cpu_limit is not set)")
        make_group(f"{self.cfg.pipeline}-{name}", cores)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal `name` and forget it (a deliberate kill is no failure). SIGKILL goes to its process
        group, so that an instance's JVM dies with it; any other signal to the process alone, as in
        `stop`: an instance stops its query, then its JVM. Signalled as a group, the JVM's own shutdown
        stopped Spark under the query's stop, and the instance logged a traceback."""
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
            _reap(proc, 30)
        log = self.logs.pop(name, None)
        if log is not None:
            log.close()

    def wait_running(self, names: list[str], timeout_s: float = 300) -> None:
        """Block until each instance has started its query (it logs "<name>: running")."""
        deadline = time.monotonic() + timeout_s
        for name in names:
            while ": running" not in (self.work / f"{name}.log").read_text(errors="replace"):
                self.check_alive()  # any process: e.g. a controller refusing its options
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not start its query within {timeout_s:.0f} s")
                time.sleep(0.5)

    def failed(self) -> dict[str, int]:
        """Processes that exited with an error (the generator exiting 0 is normal)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def check_alive(self) -> None:
        """Raise ProcessFailed, with the log's tail, if a process exited with an error."""
        failed = self.failed()
        if failed:
            who, code = next(iter(failed.items()))
            raise ProcessFailed(f"{who} exited with {code}:\n{self.log_tail(who)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The log's last lines, headed by its last root cause (a JVM trace ends far from its cause)."""
        text = (self.work / f"{name}.log").read_text(errors="replace").splitlines()
        tail = text[-lines:]
        causes = [line for line in text if line.startswith("Caused by:")]
        return "\n".join(causes[-1:] + tail if causes and causes[-1] not in tail else tail)

    def stop(self) -> None:
        """SIGTERM each process (not its group: an instance stops its query, then its JVM), then SIGKILL
        the groups of stragglers."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            _reap(proc, max(0.1, deadline - time.monotonic()))
        for log in self.logs.values():
            log.close()
        from local.cpu_budget import remove_group

        for name in self.budgeted:
            remove_group(f"{self.cfg.pipeline}-{name}")


def committed_offsets(cfg: Config, bootstrap: str) -> dict[tuple[str, int], int]:
    """(stream, pid) -> next offset that the newest commit marker of its owner says is done."""
    from pipeline.commits import newest_markers

    done: dict[tuple[str, int], int] = {}
    for marker in newest_markers(cfg, bootstrap).values():
        for stream, by_pid in marker.offsets.items():
            for pid, offset in by_pid.items():
                done[(stream, pid)] = max(done.get((stream, pid), 0), offset)
    return done


def end_offsets(cfg: Config, bootstrap: str) -> dict[tuple[str, int], int]:
    """(stream, pid) -> end offset of every input partition."""
    from pipeline.topics import admin_client, partition_offsets

    stream_of = {cfg.input_topic(s): s for s in cfg.streams}
    wanted = [(t, p) for t in stream_of for p in range(cfg.partitions)]
    return {(stream_of[t], p): o for (t, p), o in partition_offsets(admin_client(bootstrap), wanted).items()}


def backlog(cfg: Config, bootstrap: str, control: ControlLog | None = None) -> int:
    """Input messages not yet covered by a committed batch of every instance that must read them, over
    all pids.

    With an assignment of record, those are a pid's owner and, while a parallel track's source still
    reads the pid's old tuples, that source: during a track both read the pid's input (the source for
    the results with old tuples, the owner for the rest), so the furthest of the two says nothing of
    the other; and a pid handed off but not yet read by its new owner is not covered at all. Measured:
    a skew run stopped while 9 hot pids were handed off, their sources having read to the end of the
    input, and a fifth of the results were missing. Without an assignment (instances on fixed pids),
    the furthest any instance has committed.

    A caller that polls passes its `control` log, which reads on from where it stopped; without one,
    a log is opened and closed for this call."""
    from pipeline.commits import newest_markers
    from pipeline.control import ControlLog

    if control is None:
        with contextlib.closing(ControlLog(bootstrap, cfg.control_topic)) as log:
            a = log.catch_up().assignment
    else:
        a = control.catch_up().assignment
    ends = end_offsets(cfg, bootstrap)
    if a is None:
        done = committed_offsets(cfg, bootstrap)
        return sum(max(0, end - done.get(key, 0)) for key, end in ends.items())
    markers = newest_markers(cfg, bootstrap)
    left = 0
    for (stream, pid), end in ends.items():
        track = a.tracks.get(pid)
        readers = [a.owners.get(pid, ""), *([track.source] if track is not None and track.source else [])]
        read = [markers[r].offsets.get(stream, {}).get(pid, 0) if r in markers else 0 for r in readers]
        left += max(0, end - min(read))
    return left


def wait_drained(pipeline: LocalPipeline, timeout_s: float) -> None:
    """Block until every input message is covered by a committed batch of every instance that must
    read it (`backlog`), or raise."""
    from pipeline.control import ControlLog

    deadline = time.monotonic() + timeout_s
    with contextlib.closing(ControlLog(pipeline.bootstrap, pipeline.cfg.control_topic)) as control:
        while True:
            left = backlog(pipeline.cfg, pipeline.bootstrap, control)
            if left == 0:
                return
            pipeline.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{left} input messages still unprocessed after {timeout_s:.0f} s")
            time.sleep(1.0)


def weighted_percentiles(records: list[dict[str, Any]], qs: tuple[float, ...]) -> tuple[float | None, ...]:
    """Run-wide result-latency percentiles from per-batch metrics records (None when there are none).

    Each record carries an evenly spaced sample of its batch's sorted latencies; a sample value stands
    for `results / len(sample)` results, so a batch with many results weighs more than one with few.
    """
    values: list[float] = []
    weights: list[float] = []
    for r in records:
        sample = r.get("latency_sample") or []
        if not sample:
            continue
        values.extend(sample)
        weights.extend([r["results"] / len(sample)] * len(sample))
    if not values:
        return tuple(None for _ in qs)
    order = np.argsort(values)
    v, w = np.asarray(values)[order], np.asarray(weights)[order]
    position = (np.cumsum(w) - w / 2) / w.sum()
    return tuple(round(float(np.interp(q / 100, position, v)), 3) for q in qs)


class MetricsFollower:
    """Tails the metrics topic; `poll()` returns the records that arrived since the last call."""

    def __init__(self, cfg: Config, bootstrap: str) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self._consumer = Consumer(
            {
                **kafka_config(bootstrap),
                "group.id": CONSUMER_GROUP,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        meta = self._consumer.list_topics(cfg.metrics_topic, timeout=30).topics[cfg.metrics_topic]
        self._consumer.assign([TopicPartition(cfg.metrics_topic, p, 0) for p in meta.partitions])

    def poll(self) -> Iterator[dict[str, Any]]:
        for msg in consume_ready(self._consumer, 10_000, 0.2):
            value = msg.value()
            if msg.error() is None and value is not None:
                yield json.loads(value)

    def close(self) -> None:
        self._consumer.close()
