"""Executor mode (`spec.instance.executors`): what the operator renders for a driver pod and its executors,
read back the way the pod's process reads it (`pipeline.executors`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from controller.k8s.manifests import EXECUTOR_TEMPLATE_FILE, config_map, statefulset
from controller.k8s.resource import JoinPipelineSpec
from controller.k8s.spec import InstanceSettings, PipelineSpec
from fluxjoin.cli import app
from pipeline.config import ExecutorsConfig, InstanceConfig
from pipeline.executors import (
    BLOCK_MANAGER_PORT,
    DRIVER_ENV,
    DRIVER_PORT,
    EXECUTOR_BACKEND,
    NotInAPod,
    driver_conf,
    executor_command,
)
from pipeline.instance import JAVA_OPTIONS

SETTINGS = InstanceSettings(
    image="fluxjoin:test", pull_policy="Never", executor_service_account="fj-instance"
)
POD = {"metadata.name": "demo-1", "metadata.namespace": "ns", "status.podIP": "10.88.0.7",
       "spec.nodeName": "node-a"}  # fmt: skip
API_SERVER = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def _pipeline(**instance: Any) -> PipelineSpec:
    return PipelineSpec.from_object(
        {
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1},
            "spec": {
                "kafka": {"bootstrapServers": "kafka:9092", "security": {"protocol": "SASL_SSL",
                          "passwordSecret": {"name": "kafka"}}},
                "instance": instance,
            },
        }
    )  # fmt: skip


def _pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet gives it to pod `demo-1`: field references resolved,
    `$(VAR)` expanded from the variables before it."""
    env: dict[str, str] = dict(API_SERVER)
    for var in container["env"]:
        if "valueFrom" in var:
            env[var["name"]] = POD[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
    return env


def test_a_driver_pod_tells_spark_where_it_runs_and_its_executors_share_its_checkpoint_volume() -> None:
    """The driver's settings come from the pod's environment alone: the API server as master, the pod's
    IP and fixed ports for the executors to call back, the pod as their owner, the StatefulSet's claim of
    this very pod mounted at the instance's work directory, on the driver's node."""
    spec = _pipeline(executors={"count": 2, "cores": 1, "memory": "512m", "cpuRequest": "100m"})
    sts = statefulset(spec, SETTINGS, 2)
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _pod_env(container)
    executors = spec.instance.executors
    assert executors is not None
    conf = driver_conf(executors, spec.instance.work_dir, JAVA_OPTIONS, env)
    assert conf["spark.master"] == "k8s://https://10.0.0.1:443"
    assert conf["spark.executor.instances"] == "2" and conf["spark.executor.memory"] == "512m"
    assert conf["spark.kubernetes.executor.request.cores"] == "100m"
    assert conf["spark.kubernetes.driver.pod.name"] == "demo-1" and conf["spark.kubernetes.namespace"] == "ns"
    assert conf["spark.driver.host"] == "10.88.0.7"
    assert conf["spark.kubernetes.container.image"] == "fluxjoin:test"
    assert conf["spark.kubernetes.container.image.pullPolicy"] == "Never"
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    volume = "spark.kubernetes.executor.volumes.persistentVolumeClaim.checkpoint"
    assert conf[f"{volume}.options.claimName"] == f"{claim}-demo-1"
    work = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == claim)
    assert conf[f"{volume}.mount.path"] == work == spec.instance.work_dir
    assert conf["spark.kubernetes.executor.node.selector.kubernetes.io/hostname"] == "node-a"
    # Nothing but pods: no ConfigMap made, no Service or claims deleted on exit (the Role has pods only).
    assert conf["spark.kubernetes.executor.disableConfigMap"] == "true"
    assert conf["spark.kubernetes.driver.service.deleteOnTermination"] == "false"
    assert conf["spark.kubernetes.driver.ownPersistentVolumeClaim"] == "false"
    ports = {p["containerPort"] for p in container["ports"]}
    assert {int(conf["spark.driver.port"]), int(conf["spark.driver.blockManager.port"])} <= ports
    assert {DRIVER_PORT, BLOCK_MANAGER_PORT} <= ports
    assert pod["serviceAccountName"] == "fj-instance" and pod["automountServiceAccountToken"] is True
    # The pod template Spark reads is the one the ConfigMap holds, mounted where the variable says.
    template_path = env["FLUXJOIN_EXECUTOR_TEMPLATE"]
    assert conf["spark.kubernetes.executor.podTemplateFile"] == template_path
    mount = next(m for m in container["volumeMounts"] if template_path.startswith(m["mountPath"] + "/"))
    assert template_path == f"{mount['mountPath']}/{EXECUTOR_TEMPLATE_FILE}"


def test_executor_pods_run_as_the_instance_pods_do_and_cannot_call_the_api_server() -> None:
    spec = _pipeline(executors={"count": 2})
    sts = statefulset(spec, SETTINGS, 1)
    instance_pod = sts["spec"]["template"]["spec"]
    template = yaml.safe_load(config_map(spec, None, ("registry",))["data"][EXECUTOR_TEMPLATE_FILE])
    pod = template["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"] == instance_pod["securityContext"]
    assert container["securityContext"] == instance_pod["containers"][0]["securityContext"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    # Tasks read Kafka: the same credentials as the instance, as files of the same Secret.
    kafka_env = [e for e in instance_pod["containers"][0]["env"] if e["name"].startswith("FLUXJOIN_KAFKA_")]
    assert kafka_env and container["env"] == kafka_env
    assert {"name": "kafka-credentials", "mountPath": "/etc/fluxjoin/kafka", "readOnly": True} in container[
        "volumeMounts"
    ]
    # No selector of the instances' (StatefulSet, Service, PodDisruptionBudget) matches an executor.
    selector = sts["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= template["metadata"]["labels"].items()


def test_local_mode_pods_have_no_service_account_token_and_no_executor_template() -> None:
    spec = _pipeline()
    pod = statefulset(spec, SETTINGS, 1)["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is False
    assert not {e["name"] for e in pod["containers"][0]["env"]} & set(DRIVER_ENV[2:])
    assert EXECUTOR_TEMPLATE_FILE not in config_map(spec)["data"]


def test_executors_without_the_instances_service_account_fail_the_reconcile_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"executors\.enabled=true"):
        statefulset(_pipeline(executors={"count": 1}), InstanceSettings(image="fluxjoin:test"), 1)


def test_a_driver_outside_an_operator_made_pod_says_what_it_lacks() -> None:
    with pytest.raises(NotInAPod, match="FLUXJOIN_POD_IP"):
        driver_conf(ExecutorsConfig(), "/w", JAVA_OPTIONS, {**API_SERVER, "FLUXJOIN_POD_NAME": "x"})


def test_spark_master_is_local_mode_only() -> None:
    assert InstanceConfig(spark_master="local[4]").spark_master == "local[4]"
    for master in ("spark://host:7077", "local[*]", "k8s://https://x", "yarn"):
        with pytest.raises(ValueError, match="spark_master"):
            InstanceConfig(spark_master=master)
        with pytest.raises(ValueError, match=r"spec\.instance\.sparkMaster"):
            JoinPipelineSpec.read(
                {"kafka": {"bootstrapServers": "k:9092"}, "instance": {"sparkMaster": master}}
            )


def test_an_executor_runs_spark_s_kubernetes_backend_with_its_options_in_order() -> None:
    """Spark numbers the options it passes (SPARK_JAVA_OPT_0, _1, ... _10): their order is numeric."""
    env = {f"SPARK_JAVA_OPT_{i}": f"-Dopt{i}" for i in range(12)} | {
        "SPARK_EXECUTOR_MEMORY": "512m", "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@10.88.0.7:7078",
        "SPARK_EXECUTOR_ID": "2", "SPARK_EXECUTOR_CORES": "1", "SPARK_APPLICATION_ID": "spark-app",
        "SPARK_EXECUTOR_POD_IP": "10.88.0.9", "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "demo-1-exec-2",
    }  # fmt: skip
    command = executor_command(env, Path("/jars"))
    assert command[1:13] == [f"-Dopt{i}" for i in range(12)]
    assert command[13:17] == ["-Xms512m", "-Xmx512m", "-cp", "/jars/*"]
    assert command[17] == EXECUTOR_BACKEND
    args = dict(zip(command[18::2], command[19::2], strict=True))
    assert args["--driver-url"] == env["SPARK_DRIVER_URL"] and args["--hostname"] == "10.88.0.9"
    with pytest.raises(KeyError, match="SPARK_EXECUTOR_ID"):
        executor_command({k: v for k, v in env.items() if k != "SPARK_EXECUTOR_ID"}, Path("/jars"))


def test_fluxjoin_executor_outside_an_executor_pod_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [v for v in os.environ if v.startswith("SPARK_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(app, ["executor"])
    assert result.exit_code == 2
    assert "runs only in an executor pod Spark created" in result.output


def test_an_instance_with_executors_outside_a_pod_stops_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("KUBERNETES_SERVICE_HOST", "FLUXJOIN_POD_IP"):
        monkeypatch.delenv(name, raising=False)
    args = ["instance", "--name", "i0", "--set", "instance.executors.count=2", "--metrics-port", "0"]
    result = CliRunner().invoke(app, [*args, "--bootstrap", "127.0.0.1:1"])
    assert result.exit_code == 2
    assert "instance.executors needs a pod made by the fluxjoin operator" in result.output
    assert "KUBERNETES_SERVICE_HOST" in result.output and "FLUXJOIN_POD_IP" in result.output
