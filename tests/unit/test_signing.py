"""Signed control and metrics records (decision 0064): who may say what, and what a forgery meets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline import signing
from pipeline.acls import pipeline_acls
from pipeline.config import Config
from pipeline.control_view import CONTROLLER, author_of
from pipeline.protocol import AcquiredMsg, AssignmentMsg, BudgetMsg, Mode, MoveRequestMsg, ReleasedMsg
from pipeline.signing import (
    Certificate,
    Signer,
    SigningError,
    Trust,
    create_keys,
    fresh,
    load_signer,
    raw_public,
    read_public,
)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    create_keys(tmp_path, "demo", ["instance-0", "instance-1"])
    return tmp_path


def _trust(keys: Path) -> Trust:
    return Trust(read_public(keys / "controller.pub"))


@pytest.fixture
def checking(keys: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process trusts `keys`' controller and signs as instance-0."""
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "controller.pub"))
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "instance-0.key"))
    signing.trust.cache_clear()
    signing.signer.cache_clear()
    yield keys
    signing.trust.cache_clear()
    signing.signer.cache_clear()


def test_a_signer_is_named_by_its_certificate_and_the_controller_by_the_trusted_key(keys: Path) -> None:
    trust = _trust(keys)
    assert load_signer(keys / "instance-1.key", trust).name == "instance-1"
    assert load_signer(keys / "controller.key", trust).name == CONTROLLER
    assert oct((keys / "instance-1.key").stat().st_mode & 0o777) == "0o600"
    other = keys / "other"
    create_keys(other, "demo", ["instance-0"])  # a certificate from another controller key
    with pytest.raises(SigningError, match="not a certificate of this key"):
        load_signer(other / "instance-0.key", trust)
    (keys / "instance-1.cert").write_bytes((keys / "instance-0.cert").read_bytes())  # another key's
    with pytest.raises(SigningError, match="not a certificate of this key"):
        load_signer(keys / "instance-1.key", trust)
    (keys / "instance-1.cert").unlink()
    with pytest.raises(SigningError, match="no certificate"):
        load_signer(keys / "instance-1.key", trust)


def test_a_signature_binds_the_writer_the_topic_and_the_value(keys: Path) -> None:
    trust = _trust(keys)
    signer = load_signer(keys / "instance-0.key", trust)
    value = b'{"kind": "heartbeat", "instance": "instance-0"}'
    headers = signer.headers("demo.metrics", value)
    assert trust.signer("demo.metrics", value, headers) == "instance-0"
    assert trust.signer("demo.metrics", value + b" ", headers) is None, "a changed value"
    assert trust.signer("demo.control", value, headers) is None, "moved to another topic"
    assert trust.signer("other.metrics", value, signer.headers("other.metrics", value)) is None, (
        "another pipeline: the certificate is for demo"
    )
    claimed = [(signing.SIGNER_HEADER, b"instance-1"), *headers[1:]]
    assert trust.signer("demo.metrics", value, claimed) is None, "claimed by another writer"
    as_controller = [(signing.SIGNER_HEADER, CONTROLLER.encode()), *headers[1:]]
    assert trust.signer("demo.metrics", value, as_controller) is None, "claimed by the controller"
    assert trust.signer("demo.metrics", value, None) is None, "unsigned"
    assert trust.signer("demo.metrics", value, headers[:2]) is None, "without its certificate"


def test_a_writer_added_later_is_trusted_by_its_certificate_alone(keys: Path) -> None:
    trust = _trust(keys)
    create_keys(keys, "demo", ["instance-7"])  # after the reader started
    signer = load_signer(keys / "instance-7.key", _trust(keys))
    assert trust.signer("demo.metrics", b"v", signer.headers("demo.metrics", b"v")) == "instance-7"
    forged = Certificate.issue(Ed25519PrivateKey.generate(), "demo", "instance-8", raw_public(signer.key))
    headers = Signer("instance-8", signer.key, forged.to_bytes()).headers("demo.metrics", b"v")
    assert trust.signer("demo.metrics", b"v", headers) is None, "a certificate another key issued"


def test_only_the_controller_may_assign_request_or_budget_and_an_instance_speaks_for_itself() -> None:
    assert author_of(AssignmentMsg(epoch=3, owners={0: "instance-0"})) == CONTROLLER
    assert (
        author_of(MoveRequestMsg(request_id="r", pids=(0,), target="instance-1", mode=Mode.TRANSFER))
        == CONTROLLER
    )
    assert author_of(BudgetMsg(instance="instance-1", state_budget_bytes=1)) == CONTROLLER
    released = ReleasedMsg(instance="instance-1", epoch=3, pid=0, move_id="m", cutoff={"A": 1})
    assert author_of(released) == "instance-1"
    assert author_of(AcquiredMsg(instance="instance-0", epoch=3, pid=0, move_id="m")) == "instance-0"


def test_with_checking_on_a_record_is_taken_only_from_its_one_writer(checking: Path) -> None:
    value = b'{"kind": "heartbeat", "instance": "instance-1"}'
    own = signing.sign("demo.metrics", value)  # signed as instance-0
    assert own is not None
    assert signing.may_say("instance-0", "demo.metrics", value, own)
    assert not signing.may_say("instance-1", "demo.metrics", value, own), "a heartbeat for another instance"
    assert not signing.may_say(CONTROLLER, "demo.control", value, signing.sign("demo.control", value))
    assert not signing.may_say("instance-1", "demo.metrics", value, None), "unsigned"


def test_with_checking_off_every_record_is_taken_and_nothing_is_signed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(signing.TRUST_ENV, raising=False)
    monkeypatch.delenv(signing.KEY_ENV, raising=False)
    signing.trust.cache_clear()
    signing.signer.cache_clear()
    assert signing.sign("t", b"v") is None
    assert signing.may_say(CONTROLLER, "t", b"v", None)


def test_settings_that_cannot_work_fail_in_one_line(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def check() -> None:
        signing.trust.cache_clear()
        signing.signer.cache_clear()
        signing.check_settings()

    monkeypatch.delenv(signing.TRUST_ENV, raising=False)
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "instance-0.key"))
    with pytest.raises(SigningError, match="set both, or neither"):
        check()
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "nowhere.pub"))
    with pytest.raises(SigningError, match="no such file"):
        check()
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "controller.pub"))
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "missing.key"))
    with pytest.raises(SigningError, match="no such file"):
        check()
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "instance-0.cert"))
    with pytest.raises(SigningError, match="not a PEM private key"):
        check()
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "instance-0.cert"))
    with pytest.raises(SigningError, match="not a PEM public key"):
        check()
    signing.trust.cache_clear()
    signing.signer.cache_clear()


def test_a_heartbeat_copied_again_is_not_fresh_and_a_restarts_first_one_is() -> None:
    assert fresh((1, 1), None)
    assert fresh((1, 8), (1, 7))
    assert not fresh((1, 7), (1, 7)), "the same heartbeat appended again"
    assert not fresh((1, 3), (1, 7)), "an older one"
    assert fresh((2, 1), (1, 7)), "the first heartbeat of a process restarted on the same checkpoint"
    assert not fresh((1, 9), (2, 1)), "the process before the restart"


def _ops(cfg: Config, role: str) -> set[tuple[str, str, str, str]]:
    def name(value: object) -> str:
        return str(getattr(value, "name", value))

    return {
        (name(b.restype), b.name, name(b.resource_pattern_type), name(b.operation))
        for b in pipeline_acls(cfg, "User:x", role)
    }


def test_an_instances_acls_let_it_write_only_what_instances_write() -> None:
    cfg = Config(pipeline="demo")
    ops = _ops(cfg, "instance")
    assert not any(op in ("ALL", "CREATE", "DELETE", "ALTER") for *_, op in ops)
    writes = {name for kind, name, _, op in ops if kind == "TOPIC" and op == "WRITE"}
    assert writes == {
        cfg.results_topic,
        cfg.dead_letter_topic,
        cfg.sink_commits_topic,
        cfg.metrics_topic,
        cfg.control_topic,
        cfg.handoff_topic,
    }
    assert not writes & set(cfg.input_topics)
    assert ("TRANSACTIONAL_ID", "demo/", "PREFIXED", "WRITE") not in ops, (
        "the controller's and generator's ids"
    )
    generator = _ops(cfg, "generator")
    assert {n for k, n, _, op in generator if k == "TOPIC" and op == "WRITE"} == set(cfg.input_topics)
    assert ("TRANSACTIONAL_ID", "demo/generator", "LITERAL", "WRITE") in generator
    assert ("TOPIC", "demo.", "PREFIXED", "ALL") in _ops(cfg, "controller")
    with pytest.raises(ValueError, match="use one of"):
        pipeline_acls(cfg, "User:x", "admin")


def test_each_process_on_a_checkpoint_counts_its_start(tmp_path: Path) -> None:
    from pipeline.instance import _boot

    assert [_boot(tmp_path), _boot(tmp_path), _boot(tmp_path)] == [1, 2, 3]
