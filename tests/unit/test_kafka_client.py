"""Every Kafka client's connection settings (`pipeline.kafka_client`): the environment's security
settings, checked before any client is made, and a password never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.kafka_client import KafkaSecurity, KafkaSecurityError, kafka_config


def _files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "password").write_text("s3cret\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    return {"password": str(tmp_path / "password"), "ca": str(tmp_path / "ca.pem")}


def test_without_settings_a_client_connects_in_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("FLUXJOIN_KAFKA_")]:
        monkeypatch.delenv(name)
    assert kafka_config("k:9092") == {"bootstrap.servers": "k:9092", "security.protocol": "PLAINTEXT"}


def test_sasl_ssl_with_scram_reads_the_password_from_its_file(tmp_path: Path) -> None:
    f = _files(tmp_path)
    security = KafkaSecurity.from_env(
        {
            "FLUXJOIN_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
            "FLUXJOIN_KAFKA_SASL_MECHANISM": "scram-sha-512",
            "FLUXJOIN_KAFKA_SASL_USERNAME": "fluxjoin",
            "FLUXJOIN_KAFKA_SASL_PASSWORD_FILE": f["password"],
            "FLUXJOIN_KAFKA_SSL_CA_FILE": f["ca"],
        }
    )
    assert security.librdkafka() == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "fluxjoin",
        "sasl.password": "s3cret",
        "ssl.ca.location": f["ca"],
    }
    assert "s3cret" not in security.describe() and "s3cret" not in repr(security)
    assert security.describe() == f"SASL_SSL, SCRAM-SHA-512 as fluxjoin, CA {f['ca']}"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({"SECURITY_PROTOCOL": "TLS"}, "use one of PLAINTEXT, SSL", id="unknown-protocol"),
        pytest.param(
            {"SECURITY_PROTOCOL": "SASL_SSL"}, "needs FLUXJOIN_KAFKA_SASL_MECHANISM", id="no-mechanism"
        ),
        pytest.param(
            {"SECURITY_PROTOCOL": "SASL_SSL", "SASL_MECHANISM": "SCRAM-SHA-256", "SASL_USERNAME": "u"},
            "needs FLUXJOIN_KAFKA_SASL_USERNAME and FLUXJOIN_KAFKA_SASL_PASSWORD_FILE",
            id="no-password",
        ),
        pytest.param(
            {"SASL_USERNAME": "u"}, "SECURITY_PROTOCOL is PLAINTEXT: use SASL_SSL", id="sasl-on-plaintext"
        ),
        pytest.param({"SSL_CA_FILE": "{ca}"}, "use SSL or SASL_SSL", id="ca-on-plaintext"),
        pytest.param(
            {"SECURITY_PROTOCOL": "SSL", "SSL_CERT_FILE": "{ca}"},
            "SSL_KEY_FILE go together",
            id="cert-without-key",
        ),
        pytest.param(
            {"SECURITY_PROTOCOL": "SSL", "SSL_CA_FILE": "/nonexistent/ca.pem"},
            "FLUXJOIN_KAFKA_SSL_CA_FILE=/nonexistent/ca.pem: no such file",
            id="missing-file",
        ),
    ],
)
def test_settings_that_cannot_work_fail_in_one_line_naming_the_fix(
    env: dict[str, str], message: str, tmp_path: Path
) -> None:
    f = _files(tmp_path)
    environ = {f"FLUXJOIN_KAFKA_{k}": v.format(**f) for k, v in env.items()}
    with pytest.raises(KafkaSecurityError, match=message.replace("(", r"\(")) as caught:
        KafkaSecurity.from_env(environ)
    assert "\n" not in str(caught.value)


def test_a_secured_listener_for_clients_elsewhere_listens_everywhere_and_names_its_address(
    tmp_path: Path,
) -> None:
    from local.kafka_config import SaslSsl

    local = SaslSsl(tmp_path / "a").properties(9093, 9094)
    assert local["listeners"].startswith("SASL_SSL://localhost:9093,")
    remote = SaslSsl(tmp_path / "b", host="10.1.2.3").properties(9093, 9094)
    assert remote["listeners"].startswith("SASL_SSL://0.0.0.0:9093,")
    assert remote["advertised.listeners"].startswith("SASL_SSL://10.1.2.3:9093,")
    assert "CONTROLLER://localhost:9094" in remote["listeners"], "the controller listener stays local"
