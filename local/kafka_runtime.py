"""A real Apache Kafka broker on this machine: single node, KRaft, no Docker needed.

`fluxjoin kafka start` and `fluxjoin demo` must work on a laptop with nothing but Java 17 and Maven, and
on build machines that reach Maven Central but no container registry or Apache download site. Neither
Debian nor PyPI ship a Kafka broker, so the broker's jars come from Maven Central through the tiny pom
next to this file (`kafka_pom.xml`, checksums verified) into a versioned cache directory; the broker is
`java -cp 'libs/*' kafka.Kafka server.properties` started detached, so it outlives the command that
started it and `fluxjoin kafka stop` (or the demo) ends it.

`SaslSsl` starts the same broker with a SASL_SSL listener instead of PLAINTEXT: a CA and a broker
certificate made here with openssl, SCRAM-SHA-512 users, and Kafka's authorizer on (no ACL, no access),
so that tests and trials meet what a production cluster asks of its clients.

The same jars go into the broker image the integration tests run (`build_broker_image`), so tests and
demo use one Kafka version.

Layout under `cache_dir()`:
    kafka/<version>-<pom hash>/libs/        the jars; `complete` next to it once a fetch has finished
    kafka/m2/                               Maven's local repository (a re-fetch after a bump is quick)
    kafka-state/<port>/kafka.pid            pid of the broker serving <port> (always here, so
                                            `stop(port)` finds it whatever `data_dir` was)
    kafka-state/<port>/ (or data_dir)       server.properties, log4j2.properties, data/, logs/kafka.log
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

KAFKA_VERSION = "4.3.1"  # keep equal to <kafka.version> in kafka_pom.xml

POM = Path(__file__).with_name("kafka_pom.xml")
# A small heap: the demo runs the broker next to several Spark instances on a 2-core machine.
JVM_OPTS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:+ExitOnOutOfMemoryError"]
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
BROKER_IMAGE_DIR = Path(__file__).resolve().parents[1] / "tests" / "images" / "kafka"

# librdkafka reports "connection refused" while the broker boots; that is expected here, not news.
_QUIET = logging.getLogger("fluxjoin.kafka_runtime.librdkafka")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


# Brokers this process started: holding the Popen keeps Python from warning that it "is still running"
# when the object would be collected; the broker is meant to outlive us.
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


class KafkaRuntimeError(RuntimeError):
    """The embedded broker cannot be fetched, started or built; the message says what to do."""


def cache_dir() -> Path:
    env = os.environ.get("FLUXJOIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fluxjoin"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise fetches and starts between processes (parallel test runs, a demo and a CLI call)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- jars -------------------------------------------------------------------------------------------


def _pom_hash(pom: Path = POM) -> str:
    return hashlib.sha256(pom.read_bytes()).hexdigest()[:12]


def _jars_root() -> Path:
    """Versioned by the pom's content, so editing the dependency list can never reuse stale jars."""
    return cache_dir() / "kafka" / f"{KAFKA_VERSION}-{_pom_hash()}"


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise KafkaRuntimeError(
            "no `java` found: Kafka needs Java 17 or newer (Debian: apt-get install openjdk-17-jre-headless)"
        )
    return java


# Maven's words for "the repository did not answer", as opposed to "the artifact does not exist".
_UNREACHABLE = ("Could not transfer", "UnknownHost", "Connect to", "timed out", "Network is unreachable")


def ensure_jars(progress: bool = True) -> Path:
    """The `libs/` directory of Kafka KAFKA_VERSION, fetched from Maven Central on first use."""
    return ensure_maven_jars(
        POM, _jars_root(), f"Apache Kafka {KAFKA_VERSION}", f"kafka_2.13-{KAFKA_VERSION}", progress
    )


def ensure_maven_jars(pom: Path, root: Path, label: str, expect: str, progress: bool = True) -> Path:
    """`root/libs`: the runtime dependencies of `pom`, fetched with Maven (checksums verified) into the
    cache once; `expect` is the file-name prefix of a jar that must be among them."""
    libs, marker = root / "libs", root / "complete"
    if marker.is_file():
        return libs
    with _locked(root.parent / f"{root.name}.lock"):
        if marker.is_file():  # another process finished the fetch while we waited
            return libs
        _fetch_jars(pom, root, label, expect, progress)
    return libs


def _fetch_jars(pom: Path, root: Path, label: str, expect: str, progress: bool) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaRuntimeError(
            f"no `mvn` found: {label} is fetched from Maven Central with Maven "
            "(Debian: apt-get install maven)"
        )
    _java()
    partial, libs = root / "libs.partial", root / "libs"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(libs, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pom, root / "pom.xml")  # mvn writes next to its pom; the package dir may be read-only
    cmd = [
        mvn, "-B", "-C", "-f", str(root / "pom.xml"),
        f"-Dmaven.repo.local={cache_dir() / 'kafka' / 'm2'}",
        "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
    ]  # fmt: skip
    if progress:
        _say(f"fetching {label} from Maven Central (first run only) ...")
    t0 = time.monotonic()
    output: list[str] = []
    fetched = 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
    assert proc.stdout is not None
    for line in proc.stdout:
        output.append(line.rstrip())
        if progress and "Downloaded from" in line and ".jar " in line:
            fetched += 1
            if fetched % 20 == 0:
                _say(f"  {fetched} jars downloaded ...")
    if proc.wait() != 0:
        tail = "\n".join(output[-15:])
        unreachable = any(marker in line for line in output for marker in _UNREACHABLE)
        hint = (
            "Maven Central (repo.maven.apache.org) is not reachable: check the network or the proxy and "
            "mirror settings in ~/.m2/settings.xml"
            if unreachable
            else f"Maven could not resolve {label}"
        )
        raise KafkaRuntimeError(f"{hint}.\nmvn output (last lines):\n{tail}")
    jars = sorted(p.name for p in partial.glob("*.jar"))
    if not any(name.startswith(expect) for name in jars):
        raise KafkaRuntimeError(f"Maven finished but {partial} holds no {expect} jar")
    partial.rename(libs)
    (root / "complete").write_text("\n".join(jars) + "\n")
    if progress:
        _say(f"{label}: {len(jars)} jars in {libs} ({time.monotonic() - t0:.1f} s)")


# --- broker configuration (pure) ---------------------------------------------------------------------


def new_cluster_id() -> str:
    """A KRaft cluster id as Kafka's `Uuid.randomUuid()` makes it: 16 random bytes, url-safe base64.

    Like Kafka, never start with '-' (the id is passed on a command line).
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


SUPER_USER = "admin"
"""The broker's own SCRAM user under `SaslSsl`: it talks to itself as this user, a super user."""


@dataclass(frozen=True, slots=True)
class SaslSsl:
    """A SASL_SSL client listener: TLS with a certificate signed by a CA made in `directory`, SCRAM-SHA-512
    users (`users`: name -> password, besides `SUPER_USER`), Kafka's StandardAuthorizer with no access
    unless an ACL grants it. The controller listener stays PLAINTEXT on localhost, its principal
    (ANONYMOUS) a super user as KRaft needs."""

    directory: Path
    users: Mapping[str, str] = field(default_factory=dict)
    super_password: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.directory / "broker-keystore.pem"

    def make_tls(self) -> None:
        """The CA and the broker's key and certificate (for localhost), unless made already."""
        if self.keystore.exists():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        d = self.directory

        def openssl(*args: str) -> None:
            result = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
            if result.returncode != 0:
                raise KafkaRuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()[-500:]}")

        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
                "-days", "30", "-subj", "/CN=fluxjoin test CA")  # fmt: skip
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
                "-subj", "/CN=localhost")  # fmt: skip
        (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "broker.pem", "-days", "30", "-extfile", "san.ext")  # fmt: skip
        self.keystore.write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text())

    def client(self, user: str = SUPER_USER) -> dict[str, str]:
        """librdkafka settings of a client logged in as `user`."""
        password = self.super_password if user == SUPER_USER else self.users[user]
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": user,
            "sasl.password": password,
            "ssl.ca.location": str(self.ca_file),
        }

    def scram_arguments(self) -> list[str]:
        """`kafka-storage format` arguments creating every user at the cluster's birth."""
        users = {SUPER_USER: self.super_password, **self.users}
        return [
            arg
            for name, pw in users.items()
            for arg in ("--add-scram", f"SCRAM-SHA-512=[name={name},password={pw}]")
        ]

    def properties(self, port: int, controller_port: int) -> dict[str, str]:
        jaas = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{SUPER_USER}" password="{self.super_password}";'
        )
        return {
            "listeners": f"SASL_SSL://localhost:{port},CONTROLLER://localhost:{controller_port}",
            "advertised.listeners": f"SASL_SSL://localhost:{port},CONTROLLER://localhost:{controller_port}",
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca_file),
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{SUPER_USER};User:ANONYMOUS",
            "allow.everyone.if.no.acl.found": "false",
        }


def server_properties(port: int, controller_port: int, data_dir: Path, secured: SaslSsl | None = None) -> str:
    """A single-node (broker + controller) KRaft configuration for localhost; with `secured`, its client
    listener is SASL_SSL and the authorizer is on.

    Every internal topic gets replication factor 1 (the defaults of 3 make transactions and consumer
    groups hang on one node); no auto-created topics, so a typo in a topic name fails instead of
    producing into a fresh 1-partition topic that breaks co-partitioning.
    """
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.bootstrap.servers": f"localhost:{controller_port}",
        "listeners": f"PLAINTEXT://localhost:{port},CONTROLLER://localhost:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://localhost:{port},CONTROLLER://localhost:{controller_port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        # One broker: 4 partitions instead of 50 make the first transaction start in seconds, not tens.
        "transaction.state.log.num.partitions": "4",
        "offsets.topic.num.partitions": "4",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    if secured is not None:
        settings |= secured.properties(port, controller_port)
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def read_properties(text: str) -> dict[str, str]:
    """The key=value pairs of a Java properties file (the subset Kafka's own files use)."""
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


LOG4J2_PROPERTIES = """\
# Broker log for the embedded Kafka: INFO to stdout, which the launcher writes to logs/kafka.log.
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
"""


# --- processes ---------------------------------------------------------------------------------------


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
    address = f"localhost:{port}"
    pid_file = _pid_file(port)
    state = data_dir if data_dir is not None else pid_file.parent
    with _locked(pid_file.with_name("start.lock")):
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
        java = [_java(), *JVM_OPTS, log4j, "-cp", f"{libs}/*"]
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


# --- broker image for the integration tests ----------------------------------------------------------


def _image_sources() -> list[Path]:
    return sorted(p for p in BROKER_IMAGE_DIR.iterdir() if p.is_file())


def broker_image_tag() -> str:
    """`fluxjoin-kafka:<version>-<hash>`: the hash covers the image sources and the jar list (the pom)."""
    digest = hashlib.sha256(KAFKA_VERSION.encode() + POM.read_bytes())
    for path in _image_sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"fluxjoin-kafka:{KAFKA_VERSION}-{digest.hexdigest()[:12]}"


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("docker") is None:
        raise KafkaRuntimeError("no `docker` command: run scripts/ensure-docker.sh")
    return subprocess.run(["docker", *args], capture_output=True, text=True)


def build_broker_image(tag: str | None = None, progress: bool = True) -> str:
    """Build the broker image from the cached jars unless `tag` exists already; return the tag.

    A locally built image, because the build machines cannot pull `apache/kafka`; it runs the very jars
    the embedded broker runs. The sources are tests/images/kafka/ in a source checkout.
    """
    if not (BROKER_IMAGE_DIR / "Dockerfile").is_file():
        raise KafkaRuntimeError(f"no broker image sources at {BROKER_IMAGE_DIR} (needs a source checkout)")
    tag = tag or broker_image_tag()
    info = _docker("info", "--format", "{{.ServerVersion}}")
    if info.returncode != 0:
        reason = info.stderr.strip()
        raise KafkaRuntimeError(f"Docker is not reachable ({reason}): run scripts/ensure-docker.sh")
    if _docker("image", "inspect", tag).returncode == 0:
        return tag
    libs = ensure_jars(progress=progress)
    t0 = time.monotonic()
    if progress:
        _say(f"building broker image {tag} ...")
    with tempfile.TemporaryDirectory(prefix="fluxjoin-kafka-image-") as tmp:
        context = Path(tmp)
        for path in _image_sources():
            shutil.copy2(path, context / path.name)
        shutil.copytree(libs, context / "libs")
        proc = subprocess.Popen(
            ["docker", "build", "-t", tag, str(context)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        output: list[str] = []
        for line in proc.stdout:
            output.append(line.rstrip())
            if progress:
                _say(f"  {line.rstrip()}")
        if proc.wait() != 0:
            tail = "\n".join(output[-30:])
            raise KafkaRuntimeError(f"docker build of {tag} failed:\n{tail}")
    if progress:
        _say(f"built {tag} in {time.monotonic() - t0:.1f} s")
    return tag
