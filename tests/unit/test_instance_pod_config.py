"""What an instance pod runs with: the operator's rendering of a pipeline, read back by `fluxjoin instance`.

The pod's container arguments, with the files its ConfigMap volumes hold, go through the real CLI the way
the kubelet would start it (environment references expanded, volumes mounted); only the instance's run
is replaced, to capture the configuration it would start with.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import fluxjoin.run
import pipeline.instance
from controller.k8s.manifests import (
    CONFIG_HASH_ANNOTATION,
    config_map,
    instance_config,
    pod_disruption_budget,
    statefulset,
)
from controller.k8s.spec import InstanceSettings, PipelineSpec
from fluxjoin.cli import app
from pipeline.commits import transactional_id
from pipeline.config import Config

SETTINGS = InstanceSettings(image="fluxjoin:test")


def _pipeline(
    name: str, streams: list[str], namespace: str = "ns", topic_prefix: str | None = None, **spec: Any
) -> PipelineSpec:
    kafka = {"bootstrapServers": "kafka.kafka.svc:9092"} | (
        {"topicPrefix": topic_prefix} if topic_prefix else {}
    )
    return PipelineSpec.from_object(
        {
            "metadata": {"name": name, "namespace": namespace, "uid": "u-1", "generation": 1},
            "spec": {"kafka": kafka, "streams": streams, **spec},
        }
    )


def _start_pod(
    sts: dict[str, Any], config_maps: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Config, dict[str, Any]]:
    """Start the StatefulSet's container as pod `<name>-0` through the CLI; the configuration and the
    other arguments `run_instance` was called with."""
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {"FLUXJOIN_POD_NAME": f"{sts['metadata']['name']}-0", "FLUXJOIN_NAMESPACE": "ns"}
    by_name = {cm["metadata"]["name"]: cm for cm in config_maps}
    mounted: dict[str, Path] = {}
    for volume in pod.get("volumes", []):
        if "configMap" not in volume:
            continue
        files = tmp_path / volume["name"]
        files.mkdir()
        for key, text in by_name[volume["configMap"]["name"]]["data"].items():
            (files / key).write_text(text)
        for mount in container["volumeMounts"]:
            if mount["name"] == volume["name"]:
                mounted[mount["mountPath"]] = files

    def as_in_pod(arg: str) -> str:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
        for path, files in mounted.items():
            if arg.startswith(path + "/"):
                return str(files / arg[len(path) + 1 :])
        return arg

    started: list[tuple[Any, ...]] = []
    monkeypatch.setattr(
        pipeline.instance, "run_instance", lambda *args, **kwargs: started.append((*args, kwargs))
    )
    # The process's logging is this test process's: the command must not configure it here.
    monkeypatch.setattr(fluxjoin.run, "configure_logging", lambda: None)
    result = CliRunner().invoke(app, [as_in_pod(a) for a in container["args"]])
    assert result.exit_code == 0, result.output
    ((cfg, bootstrap, name, pids, kwargs),) = started
    return cfg, {"bootstrap": bootstrap, "name": name, "pids": pids, **kwargs}


@pytest.mark.parametrize(
    ("name", "streams"),
    [
        ("123", ["on", "B"]),
        ("true", ["yes", "no", "null"]),
        ("0x1f", ["off", "A"]),
        ("demo", ["A", "B", "C"]),
    ],
)
def test_a_pipeline_named_like_a_yaml_number_or_boolean_reaches_its_instances_as_written(
    name: str, streams: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Valid Kubernetes names and stream names that YAML would read as numbers, booleans or null
    (`123`, `on`) stay strings on the way into the instance: its pods would otherwise crash-loop."""
    spec = _pipeline(name, streams, topic_prefix=name, windowMs=5000, partitions=16)
    cfg, started = _start_pod(statefulset(spec, SETTINGS, 1), [config_map(spec)], tmp_path, monkeypatch)
    assert cfg.pipeline == name
    assert cfg.streams == streams
    assert cfg.input_topics == [f"{name}.in.{s}" for s in streams]
    assert (cfg.window_ms, cfg.partitions, cfg.instances) == (5000, 16, 1)
    assert cfg.instance == spec.instance
    assert (started["bootstrap"], started["name"], started["pids"]) == (
        "kafka.kafka.svc:9092",
        f"{name}-0",
        None,
    )
    assert started["metrics_port"] == SETTINGS.metrics_port == 9108


def test_a_drain_planned_restart_reaches_the_instance_and_outlasts_the_pods_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `drain` (decision 0056) the instance waits up to the drain timeout on SIGTERM, and the
    kubelet gives it that long and more before it kills it; `resume`, the default, waits for nothing."""
    resume = _pipeline("p", ["A", "B"])
    assert resume.instance.drain_timeout_s == 0
    assert statefulset(resume, SETTINGS, 1)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    drain = _pipeline("p", ["A", "B"], liveness={"plannedRestart": "drain", "drainTimeoutSeconds": 90})
    sts = statefulset(drain, SETTINGS, 1)
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    cfg, _ = _start_pod(sts, [config_map(drain)], tmp_path, monkeypatch)
    assert cfg.instance.drain_timeout_s == 90


def test_topic_settings_of_the_spec_reach_the_instances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = PipelineSpec.from_object(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {
                "kafka": {
                    "bootstrapServers": "kafka:9092",
                    "topics": {"create": False, "replicationFactor": 3, "minInsyncReplicas": 2},
                },
                "streams": ["A", "B"],
            },
        }
    )
    cfg, _ = _start_pod(statefulset(spec, SETTINGS, 1), [config_map(spec)], tmp_path, monkeypatch)
    assert (cfg.topics.create, cfg.topics.replication_factor, cfg.topics.min_insync_replicas) == (False, 3, 2)
    assert cfg.topics.retention_ms is None


def test_pipelines_of_one_name_in_two_namespaces_share_no_topic_and_no_transactional_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both run on one Kafka cluster: a shared topic would mix their data, a shared transactional id
    (`<prefix>.<instance>`) would fence one pipeline's instance with the other's."""
    configs = []
    for namespace in ("team-a", "team-b"):
        spec = _pipeline("demo", ["A", "B"], namespace=namespace)
        (tmp_path / namespace).mkdir()
        cfg, started = _start_pod(
            statefulset(spec, SETTINGS, 1), [config_map(spec)], tmp_path / namespace, monkeypatch
        )
        configs.append((cfg, started["name"]))
    (a, name_a), (b, name_b) = configs
    assert (a.pipeline, b.pipeline) == ("team-a.demo", "team-b.demo")
    topics_a = {*a.input_topics, a.results_topic, a.control_topic}
    assert not topics_a & {*b.input_topics, b.results_topic, b.control_topic}
    assert name_a == name_b == "demo-0"  # the pods' names agree; what Kafka sees does not
    assert transactional_id(a, name_a) != transactional_id(b, name_b)


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return container


def test_the_instance_serves_where_the_pod_probes_and_is_scraped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = InstanceSettings(image="fluxjoin:test", metrics_port=9200)
    spec = _pipeline("demo", ["A", "B"])
    sts = statefulset(spec, settings, 2)
    _, started = _start_pod(sts, [config_map(spec)], tmp_path, monkeypatch)
    assert started["metrics_port"] == 9200
    container = _container(sts)
    assert container["ports"] == [{"name": "metrics", "containerPort": 9200, "protocol": "TCP"}]
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "9200"
    probes = {kind: container[kind] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: p["httpGet"] for kind, p in probes.items()} == {
        "startupProbe": {"path": "/readyz", "port": "metrics"},
        "livenessProbe": {"path": "/healthz", "port": "metrics"},
        "readinessProbe": {"path": "/readyz", "port": "metrics"},
    }
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (
        "Spark's start: minutes on a small CPU"
    )
    liveness = probes["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 30


def test_the_instance_commands_default_metrics_port_is_the_operators() -> None:
    """`fluxjoin instance` run by hand, or by an older pod template without the option, serves where the
    StatefulSet's probes and scrape annotations look by default."""
    import inspect

    from fluxjoin.run import instance

    option = inspect.signature(instance).parameters["metrics_port"]
    assert option.default == InstanceSettings().metrics_port == 9108


def test_a_changed_configuration_rolls_the_pods_and_a_scale_step_does_not() -> None:
    spec = _pipeline("demo", ["A", "B"])
    changed = _pipeline("demo", ["A", "B"], windowMs=20_000)
    template = statefulset(spec, SETTINGS, 2)["spec"]["template"]
    assert statefulset(spec, SETTINGS, 5)["spec"]["template"] == template
    other = statefulset(changed, SETTINGS, 2)["spec"]["template"]
    assert other["spec"] == template["spec"], "the configuration is no argument of the pod"
    hashes = [t["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] for t in (template, other)]
    assert hashes[0] != hashes[1]
    assert config_map(spec)["data"] != config_map(changed)["data"]


def test_the_config_map_is_owned_by_the_pipeline_and_mounted_where_the_instance_reads_it() -> None:
    spec = _pipeline("demo", ["A", "B"])
    sts, cm = statefulset(spec, SETTINGS, 2), config_map(spec)
    assert cm["metadata"]["name"] == "demo"
    assert cm["metadata"]["ownerReferences"] == sts["metadata"]["ownerReferences"]
    assert cm["metadata"]["labels"] == sts["metadata"]["labels"]
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"] == {"name": "demo"}
    (mount,) = [m for m in _container(sts)["volumeMounts"] if m["name"] == volume["name"]]
    args = _container(sts)["args"]
    (key,) = cm["data"]
    assert args[args.index("--config") + 1] == f"{mount['mountPath']}/{key}"
    assert mount["readOnly"] is True
    assert "--set" not in args


def test_a_configuration_the_instance_would_refuse_fails_the_rendering_not_the_pods() -> None:
    with pytest.raises(ValueError, match="must be an identifier"):
        instance_config(_pipeline("demo", ["A", "b-c"]))


def test_the_disruption_budget_lets_one_instance_pod_go_at_a_time() -> None:
    spec = _pipeline("demo", ["A", "B"])
    sts, pdb = statefulset(spec, SETTINGS, 3), pod_disruption_budget(spec)
    assert (pdb["apiVersion"], pdb["kind"], pdb["metadata"]["name"]) == (
        "policy/v1",
        "PodDisruptionBudget",
        "demo",
    )
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]
    assert pdb["metadata"]["ownerReferences"] == sts["metadata"]["ownerReferences"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
