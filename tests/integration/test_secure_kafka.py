"""The whole pipeline against a broker that asks for TLS and SCRAM and authorizes every request.

The embedded broker (`local.kafka_config.SaslSsl`) listens for SASL_SSL only, with a CA made for
the test, SCRAM-SHA-512 users and Kafka's StandardAuthorizer with no access unless an ACL grants it.
The pipeline's principal gets exactly `fluxjoin acls`'s set; every process (generator, controller,
two Spark instances with their Python workers, the verifier) reaches the broker through the
`FLUXJOIN_KAFKA_*` settings of its environment. A move runs, the output must be exact, and clients
without credentials, with a wrong password, or of another principal must be refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.soak import Watch, acquired_by
from controller.moves.kafka_mover import request_moves
from generator.producer import run_generator
from local import kafka_runtime
from local.kafka_config import SUPER_USER, SaslSsl
from local.processes import LocalPipeline, wait_drained
from pipeline import signing
from pipeline.acls import create_acls, pipeline_acls
from pipeline.config import Config
from pipeline.control import ControlLog
from pipeline.control_view import ControlView
from pipeline.kafka_client import kafka_config
from pipeline.oracle import verify_pipeline
from pipeline.protocol import AssignmentMsg, Mode
from pipeline.protocol_codec import encode
from pipeline.signing import create_keys, load_signer, read_public
from pipeline.topics import read_topic
from tests.integration.test_pipeline import small_config

PIPELINE_USER, STRANGER = "fluxjoin", "stranger"
ROLE_USERS = {"controller": "fj-controller", "instance": "fj-instance", "generator": "fj-generator"}


@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, SaslSsl]]:
    home = tmp_path_factory.mktemp("secured-broker")
    users = {u: secrets.token_urlsafe(16) for u in (PIPELINE_USER, STRANGER, *ROLE_USERS.values())}
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


def _credentials(secured: SaslSsl, user: str, home: Path) -> dict[str, str]:
    """The `FLUXJOIN_KAFKA_*` settings that log a process in as `user`."""
    password = home / f"{user}.password"
    password.write_text(secured.users[user] + "\n")
    password.chmod(0o600)
    return {
        "FLUXJOIN_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "FLUXJOIN_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "FLUXJOIN_KAFKA_SASL_USERNAME": user,
        "FLUXJOIN_KAFKA_SASL_PASSWORD_FILE": str(password),
        "FLUXJOIN_KAFKA_SSL_CA_FILE": str(secured.ca_file),
    }


def _as(monkeypatch: pytest.MonkeyPatch, settings: dict[str, str]) -> None:
    """This process's clients (and the signing settings it reads once) from now on use `settings`."""
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    signing.trust.cache_clear()
    signing.signer.cache_clear()


def test_an_instance_cannot_assign_pids_or_heartbeat_for_another_instance(
    secured_broker: tuple[str, SaslSsl],
    topic_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A principal per role (`fluxjoin acls --role`) and a signing key per writer (`fluxjoin keys`):
    holding an instance's credentials and key, a forger publishes an assignment that gives it every pid
    and heartbeats for another instance, which is then killed. Kafka takes the records (instances write
    to the control and metrics topics), every reader drops them: the dead instance is declared dead and
    its pids recovered although its heartbeats go on, the assignment of record never holds the forged
    one, and the output is exact. Kafka itself refuses the instance's principal the writes it has no
    role for (the input, truncating the control log, the controller's transactional id)."""
    bootstrap, secured = secured_broker
    cfg = small_config(topic_prefix, "generator.max_tuples=30000", "generator.duration_s=null")
    admin = AdminClient({"bootstrap.servers": bootstrap, **secured.client()})
    for role, user in ROLE_USERS.items():
        for future in admin.create_acls(pipeline_acls(cfg, f"User:{user}", role)).values():
            future.result()
    keys = tmp_path / "keys"
    create_keys(keys, cfg.pipeline, ["instance-0", "instance-1"])
    trust = {signing.TRUST_ENV: str(keys / "controller.pub")}
    role_env = {role: _credentials(secured, user, tmp_path) | trust for role, user in ROLE_USERS.items()}
    controller_env = role_env["controller"] | {signing.KEY_ENV: str(keys / "controller.key")}

    def instance_env(name: str) -> dict[str, str]:
        return role_env["instance"] | {signing.KEY_ENV: str(keys / f"{name}.key")}

    _as(
        monkeypatch, controller_env
    )  # this process creates the topics and requests moves, as an administrator
    pipeline = LocalPipeline(cfg, bootstrap, tmp_path / "work")
    _as(monkeypatch, role_env["generator"] | {signing.KEY_ENV: ""})
    run_generator(cfg, bootstrap)
    _as(monkeypatch, controller_env)
    watch = Watch(pipeline)
    forger = Producer({**kafka_config(bootstrap), **_librdkafka(instance_env("instance-0"))})
    try:
        pipeline.start_controller(policy="static", heartbeat_timeout_s=10, env=controller_env)
        pipeline.start_instance("instance-0", env=instance_env("instance-0"))
        pipeline.start_instance("instance-1", env=instance_env("instance-1"))
        pipeline.wait_running(["instance-0", "instance-1"])
        request_moves(pipeline.cfg, bootstrap, [0], "instance-1", Mode.TRANSFER, wait_s=120)
        view = watch.until(acquired_by("instance-1", 0), 120, "pid 0 moved onto instance-1")
        assert view.assignment is not None
        forger_key = load_signer(keys / "instance-0.key", signing.Trust(read_public(keys / "controller.pub")))

        # Heartbeats for instance-1, which is dead: signed with instance-0's key, and unsigned.
        incarnation, epoch = _incarnation(cfg, bootstrap, "instance-1"), view.assignment.epoch
        pipeline.kill("instance-1")
        forging = threading.Event()

        def forge_heartbeats() -> None:
            seq = 0
            while not forging.is_set():
                seq += 1
                beat = json.dumps(
                    {"kind": "heartbeat", "instance": "instance-1", "incarnation": incarnation,
                     "serving": True, "epoch": epoch, "seq": [10**9, seq], "time_ms": int(time.time() * 1000)}
                ).encode()  # fmt: skip
                for headers in (forger_key.headers(cfg.metrics_topic, beat), None):
                    forger.produce(cfg.metrics_topic, beat, key="instance-1", headers=headers)
                forger.poll(0)
                forging.wait(0.3)

        def everything_on_0(v: ControlView) -> bool:
            return v.assignment is not None and set(v.assignment.owners.values()) == {"instance-0"}

        thread = threading.Thread(target=forge_heartbeats, daemon=True)
        thread.start()
        try:
            view = watch.until(
                everything_on_0, 180, "instance-1 declared dead, its heartbeats forged meanwhile"
            )
        finally:
            forging.set()
            thread.join(5)
        assert view.assignment is not None

        # An assignment handing every pid to the dead instance, signed by instance-0 and unsigned.
        forged_epoch = view.assignment.epoch + 100
        forged = AssignmentMsg(epoch=forged_epoch, owners=dict.fromkeys(range(cfg.partitions), "instance-1"))
        value = encode(forged)
        delivered: list[str | None] = []
        for headers in (forger_key.headers(cfg.control_topic, value), None):
            forger.produce(
                cfg.control_topic,
                value,
                headers=headers,
                on_delivery=lambda e, _m: delivered.append(None if e is None else str(e)),
            )
        forger.flush(30)
        assert delivered == [None, None], "Kafka takes an instance's writes to the control topic"
        view = watch.log.catch_up()  # read past the forgeries
        assert view.assignment is not None and view.assignment.epoch < forged_epoch
        assert everything_on_0(view)
        wait_drained(pipeline, timeout_s=300)
    finally:
        watch.log.close()
        forger.flush(10)
        pipeline.stop()
    report = verify_pipeline(pipeline.cfg, bootstrap)
    assert report.input_tuples == 30000
    assert (report.missing, report.duplicate, report.spurious) == (0, 0, 0), report.describe()

    # The forgery is in the log: a reader that checks no signature takes it.
    _as(monkeypatch, {signing.TRUST_ENV: "", signing.KEY_ENV: ""})
    with contextlib.closing(ControlLog(bootstrap, cfg.control_topic)) as unchecked:
        taken = unchecked.catch_up().assignment
    assert taken is not None and taken.epoch == forged_epoch

    # Kafka refuses the instance's principal what its role does not do.
    _as(monkeypatch, instance_env("instance-0"))
    refused: list[str] = []
    forger = Producer({**kafka_config(bootstrap), "message.timeout.ms": 20000})
    forger.produce(cfg.input_topics[0], b"x", on_delivery=lambda e, _m: refused.append(str(e)))
    forger.flush(30)
    assert refused and "AUTHORIZATION" in refused[0].upper(), refused
    instance_admin = AdminClient(kafka_config(bootstrap))
    truncate = instance_admin.delete_records([TopicPartition(cfg.control_topic, 0, 1)], request_timeout=30)
    with pytest.raises(KafkaException, match="AUTHORIZATION"):
        next(iter(truncate.values())).result()
    controllers = Producer({**kafka_config(bootstrap), "transactional.id": f"{cfg.pipeline}/controller"})
    with pytest.raises(KafkaException, match="AUTHORIZATION"):
        controllers.init_transactions(30)


def _librdkafka(env: dict[str, str]) -> dict[str, str]:
    """The client settings `env`'s `FLUXJOIN_KAFKA_*` make (`pipeline.kafka_client`)."""
    from pipeline.kafka_client import KafkaSecurity

    return KafkaSecurity.from_env(env).librdkafka()


def _incarnation(cfg: Config, bootstrap: str, instance: str) -> str:
    """The incarnation `instance` names in its newest heartbeat: what a forger reads off the metrics topic."""
    found = [
        record["incarnation"]
        for _, _, value in read_topic(bootstrap, cfg.metrics_topic)
        if (record := json.loads(value)).get("kind") == "heartbeat" and record["instance"] == instance
    ]
    assert found, f"no heartbeat of {instance}"
    return str(found[-1])
