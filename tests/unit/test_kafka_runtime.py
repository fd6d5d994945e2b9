"""The embedded broker's pure parts: ids, configuration, cache layout, restart bookkeeping.

Starting a real broker is covered by `fluxjoin kafka start` and the integration tests' image; these
check the decisions that would otherwise only show up as a broker that hangs or refuses to restart.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from local import kafka_config, kafka_dist
from local import kafka_runtime as kr


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLUXJOIN_CACHE", str(cache))
    return cache


def test_cache_dir_follows_the_environment(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kafka_dist.cache_dir() == private_cache
    monkeypatch.delenv("FLUXJOIN_CACHE")
    assert kafka_dist.cache_dir() == Path.home() / ".cache" / "fluxjoin"


def test_cluster_ids_look_like_kafkas() -> None:
    ids = {kafka_config.new_cluster_id() for _ in range(500)}
    assert len(ids) == 500
    for cid in ids:
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cid) and not cid.startswith("-")
        assert len(base64.urlsafe_b64decode(cid + "==")) == 16


def test_server_properties_make_a_single_node_cluster_usable(tmp_path: Path) -> None:
    props = kafka_config.read_properties(kafka_config.server_properties(9092, 40001, tmp_path / "data"))
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://localhost:9092,CONTROLLER://localhost:40001"
    assert props["controller.quorum.bootstrap.servers"] == "localhost:40001"
    assert props["log.dirs"] == str(tmp_path / "data")
    # One broker: every internal topic must accept replication factor 1 or transactions/groups hang.
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
    ):
        assert props[key] == "1", key
    assert props["auto.create.topics.enable"] == "false"
    assert props["group.initial.rebalance.delay.ms"] == "0"


def test_read_properties_skips_comments_and_keeps_equals_in_values() -> None:
    assert kafka_config.read_properties("# c=1\na = b=c\n\nx=\n") == {"a": "b=c", "x": ""}


def test_restart_keeps_the_controller_port_recorded_in_the_data(tmp_path: Path) -> None:
    kr._configure(tmp_path, 9092)
    first = kafka_config.read_properties((tmp_path / "server.properties").read_text())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.properties").write_text("node.id=1\n")
    kr._configure(tmp_path, 9092)
    again = kafka_config.read_properties((tmp_path / "server.properties").read_text())
    assert again["controller.quorum.bootstrap.servers"] == first["controller.quorum.bootstrap.servers"]
    assert (tmp_path / "data" / "meta.properties").exists()


def test_configuration_without_a_recorded_port_starts_from_empty_data(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.properties").write_text("node.id=1\n")  # data but no server.properties
    kr._configure(tmp_path, 9092)
    assert not (tmp_path / "data").exists()
    assert (tmp_path / "log4j2.properties").is_file()


def test_ensure_jars_trusts_only_a_completed_fetch(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = kafka_dist._jars_root()
    assert root.parent == private_cache / "kafka" and root.name.startswith(kafka_dist.KAFKA_VERSION + "-")
    (root / "libs").mkdir(parents=True)
    fetches: list[Path] = []
    monkeypatch.setattr(
        kafka_dist, "_fetch_jars", lambda pom, root, label, expect, progress: fetches.append(root)
    )
    kafka_dist.ensure_jars(progress=False)
    assert fetches == [root], "libs/ without the completion marker is a broken fetch: fetch again"
    (root / "complete").write_text("kafka_2.13.jar\n")
    assert kafka_dist.ensure_jars(progress=False) == root / "libs"
    assert fetches == [root]


def test_pom_and_runtime_agree_on_the_kafka_version() -> None:
    assert f"<kafka.version>{kafka_dist.KAFKA_VERSION}</kafka.version>" in kafka_dist.POM.read_text()


def test_no_broker_means_not_running_and_stop_is_a_no_op() -> None:
    assert kr.running_address(port=1) is None
    kr.stop(port=1)
    kr.stop(port=1)
    assert kr.running_address(port=1) is None


def test_broker_image_tag_names_version_and_content() -> None:
    tag = kafka_dist.broker_image_tag()
    assert tag == kafka_dist.broker_image_tag()
    assert re.fullmatch(rf"fluxjoin-kafka:{re.escape(kafka_dist.KAFKA_VERSION)}-[0-9a-f]{{12}}", tag)
