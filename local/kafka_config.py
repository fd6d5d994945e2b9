"""The embedded broker's configuration: a single-node KRaft `server.properties` for localhost, its
log4j2 settings, a new cluster id.

`SaslSsl` configures the same broker with a SASL_SSL listener instead of PLAINTEXT: a CA and a broker
certificate made here with openssl, SCRAM-SHA-512 users, and Kafka's authorizer on (no ACL, no access),
so that tests and trials meet what a production cluster asks of its clients.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from local.kafka_dist import KafkaRuntimeError


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
    host: str = "localhost"
    """The address clients reach the listener at, and its certificate names: another one (an IP of this
    machine) makes it listen on every interface, for clients elsewhere (pods of a cluster on this node)."""

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
        extra = "" if self.host == "localhost" else f",IP:{self.host}"
        (d / "san.ext").write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1{extra}\n")
        openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "broker.pem", "-days", "30", "-extfile", "san.ext")  # fmt: skip
        self.keystore.write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text())

    @property
    def bind(self) -> str:
        return "localhost" if self.host == "localhost" else "0.0.0.0"

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
            "listeners": f"SASL_SSL://{self.bind}:{port},CONTROLLER://localhost:{controller_port}",
            "advertised.listeners": f"SASL_SSL://{self.host}:{port},CONTROLLER://localhost:{controller_port}",
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
