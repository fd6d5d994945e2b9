"""Signed control and metrics records (decision 0064): who may say what, and what a forgery meets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import signing
from pipeline.acls import pipeline_acls
from pipeline.config import Config
from pipeline.control_view import CONTROLLER, author_of
from pipeline.protocol import AcquiredMsg, AssignmentMsg, BudgetMsg, Mode, MoveRequestMsg, ReleasedMsg
from pipeline.signing import SigningError, Trust, create_keys, fresh, load_signer


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    create_keys(tmp_path, [CONTROLLER, "instance-0", "instance-1"])
    return tmp_path


@pytest.fixture
def checking(keys: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process trusts `keys/public` and signs as instance-0."""
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "public"))
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "instance-0.key"))
    signing.trust.cache_clear()
    signing.signer.cache_clear()
    yield keys
    signing.trust.cache_clear()
    signing.signer.cache_clear()


def test_a_signers_name_is_the_trusted_public_key_that_matches_its_private_key(keys: Path) -> None:
    trust = Trust(keys / "public")
    assert load_signer(keys / "instance-1.key", trust).name == "instance-1"
    assert oct((keys / "instance-1.key").stat().st_mode & 0o777) == "0o600"
    stranger = keys / "stranger"
    create_keys(stranger, ["instance-0"])  # a key of the same name, not the trusted one
    with pytest.raises(SigningError, match="not in FLUXJOIN_TRUST_DIR"):
        load_signer(stranger / "instance-0.key", trust)


def test_a_signature_binds_the_writer_the_topic_and_the_value(keys: Path) -> None:
    trust = Trust(keys / "public")
    signer = load_signer(keys / "instance-0.key", trust)
    value = b'{"kind": "heartbeat", "instance": "instance-0"}'
    headers = signer.headers("demo.metrics", value)
    assert trust.signer("demo.metrics", value, headers) == "instance-0"
    assert trust.signer("demo.metrics", value + b" ", headers) is None, "a changed value"
    assert trust.signer("other.metrics", value, headers) is None, "moved to another topic"
    claimed = [(signing.SIGNER_HEADER, b"instance-1"), headers[1]]
    assert trust.signer("demo.metrics", value, claimed) is None, "claimed by another writer"
    assert trust.signer("demo.metrics", value, None) is None, "unsigned"
    assert trust.signer("demo.metrics", value, [(signing.SIGNER_HEADER, b"../x"), headers[1]]) is None


def test_a_writer_added_later_is_trusted_once_its_key_is_there(keys: Path) -> None:
    trust = Trust(keys / "public")
    create_keys(keys / "later", ["instance-2"])
    signer = signing.Signer(
        "instance-2", load_signer(keys / "later" / "instance-2.key", Trust(keys / "later" / "public")).key
    )
    headers = signer.headers("t", b"v")
    assert trust.signer("t", b"v", headers) is None
    (keys / "public" / "instance-2.pub").write_bytes(
        (keys / "later" / "public" / "instance-2.pub").read_bytes()
    )
    assert trust.signer("t", b"v", headers) == "instance-2"


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
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "nowhere"))
    with pytest.raises(SigningError, match="no such directory"):
        check()
    monkeypatch.setenv(signing.TRUST_ENV, str(keys / "public"))
    monkeypatch.setenv(signing.KEY_ENV, str(keys / "missing.key"))
    with pytest.raises(SigningError, match="no such file"):
        check()
    signing.trust.cache_clear()
    signing.signer.cache_clear()


def test_a_heartbeat_copied_again_is_not_fresh() -> None:
    assert fresh(1, None)
    assert fresh(8, 7)
    assert not fresh(7, 7), "the same heartbeat appended again"
    assert not fresh(3, 7), "an older one"


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
