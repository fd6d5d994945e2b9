"""A real Kafka broker for every test that needs one (integration and Kubernetes tests): one container
per test session, via testcontainers.

The broker image is built locally from the jars `fluxjoin kafka start` runs (local.kafka_dist),
because the build machines cannot pull images. Without Docker these tests fail rather than skip: a green
run must mean the pipeline was exercised against a real broker. `scripts/ensure-docker.sh` provides Docker.
"""

from __future__ import annotations

import os
import random
import re
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

# testcontainers would start its "Ryuk" reaper from Docker Hub, which the build machines cannot reach;
# the fixture removes its container itself. Set before testcontainers reads its configuration.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

BROKER_START_TIMEOUT_S = 90.0
DOCKER_HINT = "Docker is not reachable: run scripts/ensure-docker.sh (as root), then run the tests again"


# Broker ports come from below Linux's ephemeral range (32768-60999): a client reconnecting to a stopped
# broker on an ephemeral port can be handed that very port as its own source port (a TCP self-connect),
# and then holds it when the broker comes back. Also below Kubernetes' NodePort range (30000-32767).
BROKER_PORTS = range(20000, 30000)


def _free_port() -> int:
    for _ in range(100):
        port = random.choice(BROKER_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {BROKER_PORTS}")


def _broker_answers(bootstrap: str) -> bool:
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=2)
        return True
    except Exception:
        return False


@dataclass(frozen=True)
class Broker:
    """A running single-node KRaft broker in a container: where clients reach it, and the container
    (which fault tests pause, stop and start)."""

    bootstrap: str
    container: Any


@contextmanager
def running_broker() -> Iterator[Broker]:
    """A fresh broker, removed on exit.

    The host port is picked free beforehand and published 1:1, so the advertised listener
    `localhost:<port>` is right both inside the container and on the host.
    """
    import docker
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    from local import kafka_dist
    from pipeline.source import close_clients

    testcontainers_config.ryuk_disabled = True
    problem = None
    try:
        docker.from_env().ping()
    except Exception as exc:  # the SDK raises several kinds, all meaning "no daemon here"
        problem = f"{DOCKER_HINT} ({exc})"
    if problem is None:
        try:
            image = kafka_dist.build_broker_image()
        except kafka_dist.KafkaRuntimeError as exc:
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
        yield Broker(bootstrap, container.get_wrapped_container())
    finally:
        close_clients(bootstrap)
        container.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    """`localhost:<port>` of the broker every test of the session shares. No test may stop or pause it:
    one that injects a broker fault takes `own_broker`."""
    with running_broker() as broker:
        yield broker.bootstrap


@pytest.fixture
def own_broker() -> Iterator[Broker]:
    """A broker for this test alone, for tests that pause, stop or restart it."""
    with running_broker() as broker:
        yield broker


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix no other test uses (topics outlive tests on the shared broker): name + random suffix.

    Only letters, digits and '-': valid as a pipeline name and in topic names, and no '_' next to the
    '.' separators (Kafka warns that those collide in metric names).
    """
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")[:40]
    return f"t-{name}-{uuid.uuid4().hex[:8]}"
