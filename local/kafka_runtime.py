"""A real Apache Kafka broker on this machine: single node, KRaft, no Docker needed.

The broker is `java -cp 'libs/*' kafka.Kafka server.properties` started detached, so it outlives the
command that started it and `fluxjoin kafka stop` (or the demo) ends it. Its jars come from Maven Central
into a cache (`local.kafka_dist`), its configuration from `local.kafka_config` (with `SaslSsl`, a
SASL_SSL listener and the authorizer on).

Layout under `cache_dir()`:
    kafka-state/<port>/kafka.pid            pid of the broker serving <port> (always here, so
                                            `stop(port)` finds it whatever `data_dir` was)
    kafka-state/<port>/ (or data_dir)       server.properties, log4j2.properties, data/, logs/kafka.log
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from local.kafka_config import LOG4J2_PROPERTIES, SaslSsl, new_cluster_id, read_properties, server_properties
from local.kafka_dist import KafkaRuntimeError, cache_dir, ensure_jars, java_executable, locked

# A small heap: the demo runs the broker next to several Spark instances on a 2-core machine.
JVM_OPTS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError"]
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0

# librdkafka reports "connection refused" while the broker boots; that is expected here, not news.
_QUIET = logging.getLogger("fluxjoin.kafka_runtime.librdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


# Brokers this process started: holding the Popen keeps Python from warning that it "is still running"
# when the object would be collected; the broker is meant to outlive us.
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _pid_file(port: int) -> Path:
    return cache_dir() / "kafka-state" / str(port) / "kafka.pid"


def _broker_pid(port: int) -> int | None:
    """The pid of our broker for `port` if that process still runs (zombies and reused pids excluded)."""
    try:
        pid = int(_pid_file(port).read_text().strip())
    except (OSError, ValueError):
        return None
    with contextlib.suppress(ChildProcessError):  # our own child: reap it if it has exited
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    if any(proc.pid == pid for proc in _STARTED.values()):
        return pid  # ours, maybe between fork and exec, when its cmdline is still Python's
    cmdline = Path(f"/proc/{pid}/cmdline")
    with contextlib.suppress(OSError):
        if b"kafka.Kafka" not in cmdline.read_bytes():
            return None  # the pid was reused by an unrelated process
    return pid


def _port_open(port: int, host: str = "localhost") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(bootstrap: str, timeout_s: float, secured: SaslSsl | None = None) -> bool:
    """Whether the broker serves metadata (it is registered, unfenced and accepts requests)."""
    from confluent_kafka.admin import AdminClient

    conf: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap}
    if secured is not None:
        conf |= secured.client()
    admin = AdminClient(conf, logger=_QUIET)
    try:
        admin.list_topics(timeout=timeout_s)
        return True
    except Exception:  # KafkaException on timeout; anything else means "not yet" just as well
        return False


def running_address(port: int = 9092) -> str | None:
    """`localhost:PORT` if our broker for `port` runs and accepts connections, else None."""
    if _broker_pid(port) is not None and _port_open(port):
        return f"localhost:{port}"
    return None


def start(
    port: int = 9092, fresh: bool = False, data_dir: Path | None = None, secured: SaslSsl | None = None
) -> str:
    """Start the broker for `port` (or find it running) and return its bootstrap address.

    `fresh` stops a running broker and deletes its data first; otherwise topics survive restarts.
    `secured`: a SASL_SSL listener with the authorizer on (its users are made when the data is new).
    """
    address = f"{secured.host if secured is not None else 'localhost'}:{port}"
    pid_file = _pid_file(port)
    state = data_dir if data_dir is not None else pid_file.parent
    with locked(pid_file.with_name("start.lock")):
        pid = _broker_pid(port)
        if pid is not None and fresh:
            stop(port)
            pid = None
        if pid is not None:
            _wait_ready(address, pid, state / "logs" / "kafka.log", secured)
            return address
        if _port_open(port):
            raise KafkaRuntimeError(
                f"port {port} is already in use by another program; stop it or choose another port (--port)"
            )
        libs = ensure_jars(progress=True)
        if fresh:
            shutil.rmtree(state / "data", ignore_errors=True)
        if secured is not None:
            secured.make_tls()
        props = _configure(state, port, secured)
        log = state / "logs" / "kafka.log"
        if log.exists():
            log.replace(log.with_suffix(".log.1"))
        log4j = f"-Dlog4j2.configurationFile={state / 'log4j2.properties'}"
        java = [java_executable(), *JVM_OPTS, log4j, "-cp", f"{libs}/*"]
        if not (state / "data" / "meta.properties").exists():
            _format(java, props, log, secured.scram_arguments() if secured is not None else [])
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [*java, "kafka.Kafka", str(props)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not killed with the terminal or the command that started it
                cwd=state,
            )
        _STARTED[port] = proc
        pid_file.write_text(f"{proc.pid}\n")
        try:
            _wait_ready(address, proc.pid, log, secured)
        except KafkaRuntimeError:
            stop(port)
            raise
    return address


def _configure(state: Path, port: int, secured: SaslSsl | None = None) -> Path:
    """Write server.properties; an existing data dir keeps its controller port (KRaft recorded it)."""
    (state / "logs").mkdir(parents=True, exist_ok=True)
    props = state / "server.properties"
    controller_port = None
    if (state / "data" / "meta.properties").exists() and props.exists():
        voters = read_properties(props.read_text()).get("controller.quorum.bootstrap.servers", "")
        match = re.fullmatch(r"localhost:(\d+)", voters)
        controller_port = int(match.group(1)) if match else None
        if controller_port is not None and _port_open(controller_port):
            raise KafkaRuntimeError(
                f"the broker's controller port {controller_port} is taken by another program; free it or "
                "start with fresh data"
            )
    if controller_port is None:
        shutil.rmtree(state / "data", ignore_errors=True)
        controller_port = _free_port()
    props.write_text(server_properties(port, controller_port, state / "data", secured))
    (state / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
    return props


def _format(java: list[str], props: Path, log: Path, extra: list[str]) -> None:
    """Format the KRaft storage: a new cluster id, this node as the only (standalone) controller voter."""
    args = ["format", "--standalone", "-t", new_cluster_id(), "-c", str(props), *extra]
    result = subprocess.run([*java, "kafka.tools.StorageTool", *args], capture_output=True, text=True)
    with open(log, "a") as out:
        out.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise KafkaRuntimeError(f"formatting the KRaft storage failed:\n{_tail(log)}")


def _wait_ready(
    address: str, pid: int, log: Path, secured: SaslSsl | None = None, timeout_s: float = START_TIMEOUT_S
) -> None:
    port = int(address.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _broker_pid(port) != pid:
            raise KafkaRuntimeError(f"the Kafka broker exited during startup; log ({log}):\n{_tail(log)}")
        if _port_open(port) and _answers(address, timeout_s=2.0, secured=secured):
            return
        time.sleep(0.25)
    raise KafkaRuntimeError(
        f"the Kafka broker did not answer at {address} within {timeout_s:.0f} s; log ({log}):\n{_tail(log)}"
    )


def stop(port: int = 9092) -> int | None:
    """Stop the broker for `port`: SIGTERM (clean shutdown), SIGKILL after STOP_TIMEOUT_S. Idempotent.
    The process id it stopped, None when none ran."""
    pid = _broker_pid(port)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _broker_pid(port) == pid and time.monotonic() < deadline:
            time.sleep(0.1)
        if _broker_pid(port) == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while _broker_pid(port) == pid:
                time.sleep(0.05)
    _STARTED.pop(port, None)
    _pid_file(port).unlink(missing_ok=True)
    return pid


@contextlib.contextmanager
def broker_unless(bootstrap: str | None) -> Iterator[str]:
    """`bootstrap` when given; otherwise the embedded broker, started for the block and stopped after it."""
    if bootstrap:
        yield bootstrap
        return
    address = start()
    try:
        yield address
    finally:
        stop()
