"""The whole pipeline against a broker that asks for TLS and SCRAM and authorizes every request.

The embedded broker (`local.kafka_config.SaslSsl`) listens for SASL_SSL only, with a CA made for
the test, SCRAM-SHA-512 users and Kafka's StandardAuthorizer with no access unless an ACL grants it.
The pipeline's principal gets exactly `fluxjoin acls`'s set; every process (generator, controller,
two Spark instances with their Python workers, the verifier) reaches the broker through the
`FLUXJOIN_KAFKA_*` settings of its environment. A move runs, the output must be exact, and clients
without credentials, with a wrong password, or of another principal must be refused.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from bench.soak import Watch, acquired_by
from controller.moves.kafka_mover import request_moves
from generator.producer import run_generator
from local import kafka_runtime
from local.kafka_config import SUPER_USER, SaslSsl
from local.processes import LocalPipeline, wait_drained
from pipeline.acls import create_acls, pipeline_acls
from pipeline.oracle import verify_pipeline
from pipeline.protocol import Mode
from pipeline.topics import read_topic
from tests.integration.test_pipeline import small_config

PIPELINE_USER, STRANGER = "fluxjoin", "stranger"


@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SaslSsl]]:
    home = tmp_path_factory.mktemp("secured-broker")
    users = {PIPELINE_USER: secrets.token_urlsafe(16), STRANGER: secrets.token_urlsafe(16)}
    secured = SaslSsl(home / "tls", users)
    port = kafka_runtime._free_port()
    bootstrap = kafka_runtime.start(port, data_dir=home / "state", secured=secured)
    try:
        yield bootstrap, secured
    finally:
        kafka_runtime.stop(port)


def _log_in(monkeypatch: pytest.MonkeyPatch, secured: SaslSsl, user: str, tmp_path: Path) -> None:
    """This process and its children connect as `user` (the password in a file, as from a Secret)."""
    password = tmp_path / f"{user}.password"
    password.write_text(secured.users[user] + "\n")
    password.chmod(0o600)
    monkeypatch.setenv("FLUXJOIN_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("FLUXJOIN_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("FLUXJOIN_KAFKA_SASL_USERNAME", user)
    monkeypatch.setenv("FLUXJOIN_KAFKA_SASL_PASSWORD_FILE", str(password))
    monkeypatch.setenv("FLUXJOIN_KAFKA_SSL_CA_FILE", str(secured.ca_file))


def _fluxjoin(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fluxjoin", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_a_pipeline_on_a_sasl_ssl_broker_with_acls_is_exact_and_strangers_are_refused(
    secured_broker: tuple[str, SaslSsl],
    topic_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bootstrap, secured = secured_broker
    cfg = small_config(topic_prefix, "generator.max_tuples=30000", "generator.duration_s=null")
    settings: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap, **secured.client()}
    admin = AdminClient(settings)  # held until the answers: a dropped client fails them
    for future in admin.create_acls(pipeline_acls(cfg, f"User:{PIPELINE_USER}")).values():
        future.result()

    _log_in(monkeypatch, secured, PIPELINE_USER, tmp_path)
    run_generator(cfg, bootstrap)
    pipeline = LocalPipeline(cfg, bootstrap, tmp_path / "work")
    watch = Watch(pipeline)
    try:
        pipeline.start_controller(policy="static")
        pipeline.start_instance("instance-0")
        pipeline.start_instance("instance-1")
        pipeline.wait_running(["instance-0", "instance-1"])
        request_moves(pipeline.cfg, bootstrap, [0], "instance-1", Mode.TRANSFER, wait_s=120)
        watch.until(acquired_by("instance-1", 0), 120, "pid 0 moved onto instance-1")
        wait_drained(pipeline, timeout_s=300)
    finally:
        watch.log.close()
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    assert report.input_tuples == 30000
    assert report.expected > 10_000, "the workload must produce a meaningful number of results"
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()

    # The pipeline's own principal, through the CLI: it reads what it may.
    env = dict(os.environ)
    answered = _fluxjoin("status", "--config", str(pipeline.config_path), "--json", env=env)
    assert answered.returncode == 0, answered.stderr[-2000:]
    status = json.loads(answered.stdout)
    by_name = {i["instance"]: i for i in status["instances"]}
    assert 0 in by_name["instance-1"]["pids"] and status["moves"] == []
    assert sorted(p for i in by_name.values() for p in i["pids"]) == list(range(cfg.partitions))
    assert [i["lag"] for i in by_name.values()] == [0, 0], "drained: nothing beyond the newest batches"

    # No credentials: the TLS listener does not speak plain Kafka. One line, exit status 3.
    plain = {k: v for k, v in env.items() if not k.startswith("FLUXJOIN_KAFKA_")}
    refused = _fluxjoin("status", "--config", str(pipeline.config_path), env=plain)
    assert refused.returncode == 3, refused.stderr[-2000:]
    assert refused.stderr.startswith("error: ") and len(refused.stderr.strip().splitlines()) == 1, (
        refused.stderr
    )

    # A wrong password: refused the same way.
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    refused = _fluxjoin(
        "status",
        "--config",
        str(pipeline.config_path),
        env=env | {"FLUXJOIN_KAFKA_SASL_PASSWORD_FILE": str(wrong)},
    )
    assert refused.returncode == 3, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    # Another principal, logged in: the pipeline's topics are closed to it, reading and writing.
    _log_in(monkeypatch, secured, STRANGER, tmp_path)
    with pytest.raises(RuntimeError, match="TOPIC_AUTHORIZATION_FAILED"):
        list(read_topic(bootstrap, cfg.results_topic, timeout_s=30))
    producer = Producer({"bootstrap.servers": bootstrap, **secured.client(STRANGER)})
    failures: list[str] = []
    producer.produce(cfg.control_topic, b"x", on_delivery=lambda err, _msg: failures.append(str(err)))
    producer.flush(30)
    assert failures and "AUTHORIZATION" in failures[0].upper(), failures

    # Creating the ACLs again (as `fluxjoin acls --apply` would, on a second install) is no error.
    monkeypatch.setenv("FLUXJOIN_KAFKA_SASL_USERNAME", SUPER_USER)
    (tmp_path / "admin.password").write_text(secured.super_password)
    monkeypatch.setenv("FLUXJOIN_KAFKA_SASL_PASSWORD_FILE", str(tmp_path / "admin.password"))
    create_acls(bootstrap, pipeline_acls(cfg, f"User:{PIPELINE_USER}"))
