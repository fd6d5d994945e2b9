"""Apache Kafka's jars for this machine, and the broker image the integration tests build from them.

`fluxjoin kafka start` and `fluxjoin demo` must work on a laptop with nothing but Java 17 and Maven, and
on build machines that reach Maven Central but no container registry or Apache download site. Neither
Debian nor PyPI ship a Kafka broker, so the broker's jars come from Maven Central through the tiny pom
next to this file (`kafka_pom.xml`, checksums verified) into a versioned cache directory (`ensure_jars`);
`local.kafka_runtime` runs the broker from them.

The same jars go into the broker image the integration tests run (`build_broker_image`), so tests and
demo use one Kafka version.

Layout under `cache_dir()`:
    kafka/<version>-<pom hash>/libs/        the jars; `complete` next to it once a fetch has finished
    kafka/m2/                               Maven's local repository (a re-fetch after a bump is quick)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

KAFKA_VERSION = "4.3.1"  # keep equal to <kafka.version> in kafka_pom.xml

POM = Path(__file__).with_name("kafka_pom.xml")
BROKER_IMAGE_DIR = Path(__file__).resolve().parents[1] / "tests" / "images" / "kafka"


class KafkaRuntimeError(RuntimeError):
    """The embedded broker cannot be fetched, started or built; the message says what to do."""


def cache_dir() -> Path:
    env = os.environ.get("FLUXJOIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fluxjoin"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
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


def java_executable() -> str:
    """The `java` that runs Kafka: $JAVA_HOME's, else the first on the PATH."""
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
    with locked(root.parent / f"{root.name}.lock"):
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
    java_executable()
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
