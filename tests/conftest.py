"""A real Kafka broker for every test that needs one (integration and Kubernetes tests): one container
per test session, via testcontainers.

The broker image is built locally from the jars `fluxjoin kafka start` runs (controller.kafka_runtime),
because the build machines cannot pull images. Without Docker these tests fail rather than skip: a green
run must mean the pipeline was exercised against a real broker. `scripts/ensure-docker.sh` provides Docker.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

# testcontainers would start its "Ryuk" reaper from Docker Hub, which the build machines cannot reach;
# the fixture removes its container itself. Set before testcontainers reads its configuration.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

BROKER_START_TIMEOUT_S = 90.0
DOCKER_HINT = "Docker is not reachable: run scripts/ensure-docker.sh (as root), then run the tests again"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _broker_answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """`localhost:<port>` of a fresh single-node KRaft broker, removed at the end of the session.

    The host port is picked free beforehand and published 1:1, so the advertised listener
    `localhost:<port>` is right both inside the container and on the host.
    """
    import docker
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    from controller import kafka_runtime
    from pipeline.source import close_clients

    testcontainers_config.ryuk_disabled = True
    problem = None
    try:
        docker.from_env().ping()
    except Exception as exc:  # the SDK raises several kinds, all meaning "no daemon here"
        problem = f"{DOCKER_HINT} ({exc})"
    if problem is None:
        try:
            image = kafka_runtime.build_broker_image()
        except kafka_runtime.KafkaRuntimeError as exc:
            problem = f"cannot build the Kafka broker image: {exc}"
    if problem is not None:  # outside the except blocks: one clear message, no chained traceback
        pytest.fail(problem, pytrace=False)

    port = _free_port()
    bootstrap = f"localhost:{port}"
    container = (
        DockerContainer(image)
        .with_name(f"fluxjoin-test-kafka-{port}")
        .with_env("KAFKA_PORT", str(port))
        .with_env("KAFKA_ADVERTISED_LISTENERS", f"PLAINTEXT://{bootstrap}")
        .with_bind_ports(port, port)
    )
    container.start()
    try:
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        while not _broker_answers(bootstrap):
            container.reload()
            if container.status != "running" or time.monotonic() > deadline:
                logs = b"".join(container.get_logs()).decode(errors="replace")[-4000:]
                problem = f"the Kafka container did not answer at {bootstrap} ({container.status})"
                pytest.fail(f"{problem}:\n{logs}", pytrace=False)
            time.sleep(0.5)
        yield bootstrap
    finally:
        close_clients(bootstrap)
        container.stop()


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix no other test uses (topics outlive tests on the shared broker): name + random suffix.

    Only letters, digits and '-': valid as a pipeline name and in topic names, and no '_' next to the
    '.' separators (Kafka warns that those collide in metric names).
    """
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")[:40]
    return f"t-{name}-{uuid.uuid4().hex[:8]}"
