"""How every fluxjoin Kafka client connects: the bootstrap address and the security settings.

Every client (generator, source and sink in every Spark worker, controller, operator, verifier,
benchmarks) is configured by `kafka_config`, so a broker behind TLS or SASL is reached by all of them or
by none. The security settings come from the process's environment, `FLUXJOIN_KAFKA_*`:

- `FLUXJOIN_KAFKA_SECURITY_PROTOCOL`: PLAINTEXT (the default), SSL, SASL_PLAINTEXT or SASL_SSL;
- `FLUXJOIN_KAFKA_SASL_MECHANISM`: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512;
- `FLUXJOIN_KAFKA_SASL_USERNAME`, and `FLUXJOIN_KAFKA_SASL_PASSWORD_FILE`: a file holding the password;
- `FLUXJOIN_KAFKA_SSL_CA_FILE`: the CA (PEM) that signed the brokers' certificates;
- `FLUXJOIN_KAFKA_SSL_CERT_FILE`, `FLUXJOIN_KAFKA_SSL_KEY_FILE`: a client certificate and its key (PEM),
  for brokers that ask for one.

The environment, not the configuration file, because it is what every process inherits: Spark's Python
workers, the instances the local runtime starts, and a pod's containers, to which Kubernetes hands a
Secret as files. The password is read from a file so that it never sits in an environment listing,
a process's arguments or a log; `describe` names the settings without it (decision 0057).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
ENV_PREFIX = "FLUXJOIN_KAFKA_"
CONSUMER_GROUP = "fluxjoin-unused"
"""The `group.id` every fluxjoin consumer names and none joins: offsets are never committed to Kafka
(Spark's checkpoints own them). On a cluster with ACLs the pipeline's principal may read as it
(`pipeline.acls`)."""


class KafkaSecurityError(ValueError):
    """The security settings in the environment are incomplete or contradict each other."""


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """The security settings of this process's Kafka clients (see the module's table)."""

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password_file: Path | None = None
    ssl_ca_file: Path | None = None
    ssl_cert_file: Path | None = None
    ssl_key_file: Path | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KafkaSecurity:
        """The settings in `environ` (the process's environment by default); KafkaSecurityError names
        what is wrong and how to fix it."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(ENV_PREFIX + name) or None

        def path(name: str) -> Path | None:
            value = get(name)
            if value is None:
                return None
            if not Path(value).is_file():
                raise KafkaSecurityError(f"{ENV_PREFIX}{name}={value}: no such file")
            return Path(value)

        protocol = (get("SECURITY_PROTOCOL") or "PLAINTEXT").upper()
        if protocol not in PROTOCOLS:
            raise KafkaSecurityError(
                f"{ENV_PREFIX}SECURITY_PROTOCOL={protocol}: use one of {', '.join(PROTOCOLS)}"
            )
        security = cls(
            protocol=protocol,
            sasl_mechanism=(get("SASL_MECHANISM") or "").upper() or None,
            sasl_username=get("SASL_USERNAME"),
            sasl_password_file=path("SASL_PASSWORD_FILE"),
            ssl_ca_file=path("SSL_CA_FILE"),
            ssl_cert_file=path("SSL_CERT_FILE"),
            ssl_key_file=path("SSL_KEY_FILE"),
        )
        security.check()
        return security

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol.endswith("SSL")

    def check(self) -> None:
        """KafkaSecurityError unless the settings make sense together."""
        sasl_given = [n for n, v in (("SASL_USERNAME", self.sasl_username),
                                     ("SASL_PASSWORD_FILE", self.sasl_password_file)) if v]  # fmt: skip
        if self.sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise KafkaSecurityError(
                    f"{self.protocol} needs {ENV_PREFIX}SASL_MECHANISM: one of {', '.join(MECHANISMS)}"
                )
            if len(sasl_given) < 2:
                raise KafkaSecurityError(
                    f"{self.protocol} needs {ENV_PREFIX}SASL_USERNAME and {ENV_PREFIX}SASL_PASSWORD_FILE"
                )
        elif sasl_given or self.sasl_mechanism:
            raise KafkaSecurityError(
                f"SASL settings given, but {ENV_PREFIX}SECURITY_PROTOCOL is {self.protocol}: "
                "use SASL_SSL (or SASL_PLAINTEXT)"
            )
        if not self.tls and (self.ssl_ca_file or self.ssl_cert_file or self.ssl_key_file):
            raise KafkaSecurityError(
                f"TLS files given, but {ENV_PREFIX}SECURITY_PROTOCOL is {self.protocol}: use SSL or SASL_SSL"
            )
        if bool(self.ssl_cert_file) != bool(self.ssl_key_file):
            raise KafkaSecurityError(f"{ENV_PREFIX}SSL_CERT_FILE and {ENV_PREFIX}SSL_KEY_FILE go together")

    def librdkafka(self) -> dict[str, str]:
        """The settings as librdkafka (confluent-kafka) takes them; the password read from its file."""
        conf = {"security.protocol": self.protocol}
        if self.sasl:
            assert self.sasl_mechanism and self.sasl_username and self.sasl_password_file
            conf["sasl.mechanism"] = self.sasl_mechanism
            conf["sasl.username"] = self.sasl_username
            conf["sasl.password"] = self.sasl_password_file.read_text().strip()
        for key, value in (
            ("ssl.ca.location", self.ssl_ca_file),
            ("ssl.certificate.location", self.ssl_cert_file),
            ("ssl.key.location", self.ssl_key_file),
        ):
            if value is not None:
                conf[key] = str(value)
        return conf

    def describe(self) -> str:
        """One line naming the settings, never the password."""
        parts = [self.protocol]
        if self.sasl:
            parts.append(f"{self.sasl_mechanism} as {self.sasl_username}")
        if self.ssl_ca_file:
            parts.append(f"CA {self.ssl_ca_file}")
        if self.ssl_cert_file:
            parts.append(f"client certificate {self.ssl_cert_file}")
        return ", ".join(parts)


def kafka_config(bootstrap: str) -> dict[str, Any]:
    """The connection settings of a Kafka client of this process: `bootstrap.servers` and the security
    settings of the environment. Callers add their own settings to it."""
    return {"bootstrap.servers": bootstrap, **KafkaSecurity.from_env().librdkafka()}
