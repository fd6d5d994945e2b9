"""The chart, the CRD and the plain manifests against a real kube-apiserver (server-side validation,
admission and RBAC as a cluster applies them; no pods run)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.k8s.cluster import GROUP, PLURAL, REPO, VERSION, KubeCluster, pipeline_manifest

CHART = REPO / "charts" / "fluxjoin"

# Value sets that together switch on every template of the chart.
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "external-kafka": ["--set", "pipeline.create=true,kafka.bootstrapServers=kafka.kafka.svc:9092"],
    "trial-kafka-generator": [
        "--set", "pipeline.create=true,kafka.trial.enabled=true,generator.enabled=true",
        "--set", "pipeline.checkpoint.storageClassName=fast,imagePullSecrets[0].name=registry",
        "--set", "operator.podAnnotations.team=streams",
    ],
    "signing": ["--set", "signing.enabled=true"],
}  # fmt: skip


def _custom(kube: KubeCluster) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(kube.api_client)


def _plain(kube: KubeCluster, obj: object) -> dict[str, Any]:
    """A typed client model or a custom object as the plain JSON-like dict the API sent."""
    plain = kube.api_client.sanitize_for_serialization(obj)
    assert isinstance(plain, dict)
    return plain


def _getpipeline_manifest(kube: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    return _plain(kube, _custom(kube).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))


def _list_pipelines(kube: KubeCluster, namespace: str) -> list[Any]:
    items = _plain(kube, _custom(kube).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL))[
        "items"
    ]
    assert isinstance(items, list)
    return items


def _scale(kube: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    return _plain(
        kube, _custom(kube).get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, name)
    )


def _relative_overlay(tmp_path: Path, namespace: str) -> Path:
    """A kustomize overlay in tmp_path on top of k8s/ that moves everything into `namespace`."""
    base = os.path.relpath(REPO / "k8s", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": [base], "namespace": namespace}, sort_keys=False)
    )
    return tmp_path


# --- helm install / upgrade / uninstall ---


def test_helm_install_creates_every_object(kube: KubeCluster, namespace: str, crd: None) -> None:
    out = kube.helm("install", "fj", str(CHART), "-n", namespace, *VALUE_SETS["trial-kafka-generator"])
    assert "STATUS: deployed" in out.stdout
    assert f"kubectl -n {namespace} scale joinpipeline/fj-fluxjoin --replicas=4" in out.stdout  # NOTES.txt

    apps = kubernetes.client.AppsV1Api(kube.api_client)
    core = kubernetes.client.CoreV1Api(kube.api_client)
    rbac = kubernetes.client.RbacAuthorizationV1Api(kube.api_client)
    pod = _plain(kube, apps.read_namespaced_deployment("fj-fluxjoin-operator", namespace))["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["operator"]
    assert container["image"] == "fluxjoin:0.1.0"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["team"] == "streams"
    assert pod["spec"]["serviceAccountName"] == "fj-fluxjoin-operator"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry"}]
    apps.read_namespaced_deployment("fj-fluxjoin-generator", namespace)
    apps.read_namespaced_stateful_set("fj-fluxjoin-kafka", namespace)
    core.read_namespaced_service("fj-fluxjoin-kafka", namespace)
    core.read_namespaced_config_map("fj-fluxjoin-generator", namespace)
    core.read_namespaced_service_account("fj-fluxjoin-operator", namespace)
    rbac.read_namespaced_role("fj-fluxjoin-operator", namespace)
    rbac.read_namespaced_role_binding("fj-fluxjoin-operator", namespace)

    spec = _getpipeline_manifest(kube, namespace, "fj-fluxjoin")["spec"]
    assert spec["kafka"] == {
        "bootstrapServers": f"fj-fluxjoin-kafka.{namespace}.svc:9092",
        "topicPrefix": f"{namespace}.fj-fluxjoin",
    }
    assert spec["checkpoint"] == {"size": "5Gi", "storageClassName": "fast"}
    assert (spec["partitions"], spec["replicas"], spec["windowMs"]) == (64, 3, 10000)


SECURED = [
    "--set", "pipeline.create=true,generator.enabled=true,kafka.bootstrapServers=kafka.kafka.svc:9093",
    "--set", "kafka.security.protocol=SASL_SSL,kafka.security.saslMechanism=SCRAM-SHA-512",
    "--set", "kafka.security.username=fluxjoin,kafka.security.passwordSecret.name=fluxjoin-user",
    "--set", "kafka.security.caSecret.name=kafka-cluster-ca-cert",
]  # fmt: skip


def test_kafka_credentials_from_a_secret_reach_every_pod_as_files_and_nowhere_else(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    """The operator, the generator and (through spec.kafka.security, rendered by the operator) every
    instance pod log in alike: FLUXJOIN_KAFKA_* naming files of a projected Secret volume. The password
    itself is in none of the objects the chart or the operator write."""
    from controller.k8s.manifests import KAFKA_CREDENTIALS_DIR, kafka_credentials, statefulset
    from controller.k8s.spec import InstanceSettings, PipelineSpec

    password = "pw-" + namespace
    core = kubernetes.client.CoreV1Api(kube.api_client)
    core.create_namespaced_secret(
        namespace,
        kubernetes.client.V1Secret(
            metadata=kubernetes.client.V1ObjectMeta(name="fluxjoin-user"), string_data={"password": password}
        ),
    )
    kube.helm("install", "fj", str(CHART), "-n", namespace, *SECURED)
    apps = kubernetes.client.AppsV1Api(kube.api_client)
    pipeline = _getpipeline_manifest(kube, namespace, "fj-fluxjoin")
    env, volume = kafka_credentials(pipeline["spec"]["kafka"]["security"])
    assert {e["name"]: e["value"] for e in env} == {
        "FLUXJOIN_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "FLUXJOIN_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "FLUXJOIN_KAFKA_SASL_USERNAME": "fluxjoin",
        "FLUXJOIN_KAFKA_SASL_PASSWORD_FILE": f"{KAFKA_CREDENTIALS_DIR}/password",
        "FLUXJOIN_KAFKA_SSL_CA_FILE": f"{KAFKA_CREDENTIALS_DIR}/ca.crt",
    }
    sts = statefulset(PipelineSpec.from_object(pipeline), InstanceSettings(image="fluxjoin:test"), 1)
    kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input_text=json.dumps(sts))
    instance_pod = sts["spec"]["template"]["spec"]
    pods = {
        "operator": _plain(kube, apps.read_namespaced_deployment("fj-fluxjoin-operator", namespace)),
        "generator": _plain(kube, apps.read_namespaced_deployment("fj-fluxjoin-generator", namespace)),
    }
    for name, deployment in pods.items():
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert [e for e in container["env"] if e["name"].startswith("FLUXJOIN_KAFKA_")] == env, name
        assert [v for v in pod["volumes"] if v["name"] == "kafka-credentials"] == [volume], name
        assert {
            "name": "kafka-credentials",
            "mountPath": KAFKA_CREDENTIALS_DIR,
            "readOnly": True,
        } in container["volumeMounts"], name
    (instance,) = instance_pod["containers"]
    assert [e for e in instance["env"] if e["name"].startswith("FLUXJOIN_KAFKA_")] == env
    assert volume in instance_pod["volumes"]
    everything = json.dumps([pipeline, pods, instance_pod])
    assert password not in everything


def test_helm_generator_config_is_a_valid_pipeline_config(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    """The generator's ConfigMap holds a file `fluxjoin generate --config` accepts."""
    from pipeline.config import load_config

    kube.helm("install", "fj", str(CHART), "-n", namespace, *VALUE_SETS["trial-kafka-generator"])
    data = kubernetes.client.CoreV1Api(kube.api_client).read_namespaced_config_map(
        "fj-fluxjoin-generator", namespace
    )
    path = kube.workdir / f"{namespace}-generator.yaml"
    assert data.data is not None
    path.write_text(data.data["fluxjoin.yaml"])
    cfg = load_config(path)
    assert cfg.pipeline == f"{namespace}.fj-fluxjoin"  # the operator's default prefix, so topics agree
    assert cfg.bootstrap == f"fj-fluxjoin-kafka.{namespace}.svc:9092"
    assert cfg.input_topics == [f"{namespace}.fj-fluxjoin.in.{s}" for s in "ABC"]
    assert cfg.generator.duration_s is None


def test_helm_upgrade_and_uninstall(kube: KubeCluster, namespace: str, crd: None) -> None:
    kube.helm("install", "fj", str(CHART), "-n", namespace, *VALUE_SETS["external-kafka"])
    kube.helm("upgrade", "fj", str(CHART), "-n", namespace, "--reuse-values", "--set", "pipeline.replicas=5")
    assert _getpipeline_manifest(kube, namespace, "fj-fluxjoin")["spec"]["replicas"] == 5
    kube.helm("uninstall", "fj", "-n", namespace)
    assert _list_pipelines(kube, namespace) == []
    # The CRD is never deleted by Helm (it would take every pipeline in the cluster with it).
    kube.kubectl("get", "crd", "joinpipelines.fluxjoin.io")


def test_helm_install_of_only_the_operator(kube: KubeCluster, namespace: str, crd: None) -> None:
    kube.helm("install", "op", str(CHART), "-n", namespace)
    assert _list_pipelines(kube, namespace) == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "pipeline.create=true"], "no Kafka: set kafka.bootstrapServers=HOST:PORT"),
        (
            ["--set", "kafka.trial.enabled=true", "--set", "kafka.bootstrapServers=k:9092"],
            "set either kafka.bootstrapServers",
        ),
        (
            [
                "--set",
                "pipeline.create=true",
                "--set",
                "kafka.bootstrapServers=k:9092",
                "--set",
                "pipeline.replicas=65",
            ],
            "pipeline.partitions (64) must be >= pipeline.replicas (65)",
        ),
        (["--set", "pipeline.windowMs=0"], "windowMs"),
        (["--set", "pipeline.handoffMode=teleport"], "handoffMode"),
        (["--set", "operator.replica=2"], "replica"),
    ],
)
def test_helm_rejects_bad_values_with_a_clear_message(
    kube: KubeCluster, namespace: str, values: list[str], message: str
) -> None:
    out = kube.helm("install", "bad", str(CHART), "-n", namespace, *values, check=False)
    assert out.returncode != 0
    assert message in out.stderr


# --- the CRD: validation, scale and status subresources ---


def test_invalid_pipeline_is_rejected_with_the_validation_messages(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    bad = pipeline_manifest("bad", partitions=2, replicas=4, windowMs=0)
    out = kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=bad, check=False)
    assert out.returncode != 0
    assert "partitions must be >= replicas" in out.stderr
    assert "spec.windowMs" in out.stderr
    assert "should be greater than or equal to 1" in out.stderr

    # The same through the Python client: the API's status carries the rule's message.
    body = yaml.safe_load(pipeline_manifest("bad2", partitions=1, replicas=2))
    with pytest.raises(kubernetes.client.ApiException) as err:
        _custom(kube).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert err.value.status == 422
    assert "partitions must be >= replicas" in json.loads(err.value.body or "{}")["message"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"streams": ["A"]}, "should have at least 2 items"),
        ({"streams": ["A", "A"]}, "Duplicate value"),
        ({"streams": ["A", "1x"]}, "should match"),
        ({"handoffMode": "teleport"}, 'supported values: "transfer", "replay", "parallel_track"'),
        ({"policy": {"name": "flux", "flux": {"deltaS": 0.1, "deltaMinS": 0.5}}}, "deltaMinS must be <="),
        ({"partitions": 5000}, "should be less than or equal to 4096"),
        ({"kafka": {"bootstrapServers": "no-port"}}, "spec.kafka.bootstrapServers"),
        ({"checkpoint": {"size": "lots"}}, "spec.checkpoint.size"),
    ],
)
def test_invalid_specs_name_the_field(
    kube: KubeCluster, namespace: str, crd: None, spec: dict[str, Any], message: str
) -> None:
    out = kube.kubectl(
        "apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("bad", **spec), check=False
    )
    assert out.returncode != 0
    assert message in out.stderr


def test_defaults_are_filled_in_by_the_server(kube: KubeCluster, namespace: str, crd: None) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("x"))
    spec = _getpipeline_manifest(kube, namespace, "x")["spec"]
    assert spec["streams"] == ["A", "B", "C"]
    assert (spec["windowMs"], spec["partitions"], spec["replicas"]) == (10000, 64, 3)
    assert spec["policy"]["name"] == "flux"
    assert spec["policy"]["flux"] == {
        "thImb": 1.2,
        "thUtil": 0.9,
        "deltaS": 1,
        "deltaMinS": 0.25,
        "maxMovesPerPair": 1,
        "minMoveShare": 0,
        "donorCost": False,
        "phaseInterval": True,
    }
    assert spec["handoffMode"] == "transfer"
    assert spec["checkpoint"] == {"size": "5Gi"}


def test_partitions_streams_and_topic_prefix_are_immutable(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("x"))
    for patch, message in [
        ('{"spec":{"partitions":32}}', "partitions is immutable"),
        ('{"spec":{"streams":["A","B"]}}', "streams is immutable"),
        ('{"spec":{"kafka":{"topicPrefix":"other"}}}', "kafka.topicPrefix is immutable"),
    ]:
        out = kube.kubectl(
            "patch", "-n", namespace, "joinpipeline/x", "--type=merge", "-p", patch, check=False
        )
        assert out.returncode != 0, patch
        assert message in out.stderr
    kube.kubectl(
        "patch", "-n", namespace, "joinpipeline/x", "--type=merge", "-p", '{"spec":{"windowMs":5000}}'
    )


def test_kubectl_scale_goes_through_the_scale_subresource(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("x", partitions=8))
    kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=4")
    assert _getpipeline_manifest(kube, namespace, "x")["spec"]["replicas"] == 4

    scale = _scale(kube, namespace, "x")
    assert scale["spec"]["replicas"] == 4

    # More instances than pids is refused by the CRD's rule, through the scale subresource too.
    out = kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=9", check=False)
    assert out.returncode != 0
    assert "partitions must be >= replicas" in out.stderr
    out = kube.kubectl("scale", "-n", namespace, "joinpipeline/x", "--replicas=0", check=False)
    assert out.returncode != 0
    assert "should be greater than or equal to 1" in out.stderr
    assert _getpipeline_manifest(kube, namespace, "x")["spec"]["replicas"] == 4


def test_status_subresource_feeds_scale_and_printer_columns(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    kube.kubectl(
        "apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("x", partitions=8, replicas=2)
    )
    status = {
        "status": {
            "observedGeneration": 1,
            "replicas": 2,
            "readyReplicas": 2,
            "selector": "app.kubernetes.io/instance=x,app.kubernetes.io/component=instance",
            "epoch": 7,
            "assignment": [
                {"instance": "x-0", "pids": "0-3", "count": 4},
                {"instance": "x-1", "pids": "4-7", "count": 4},
            ],
            "movesInFlight": 1,
            "tuplesPerSecond": 1234.5,
            "lag": 10,
            "moves": [
                {"pid": 3, "from": "x-0", "to": "x-1", "mode": "transfer", "phase": "exporting", "epoch": 8}
            ],
            "instances": [
                {"name": "x-0", "ready": True, "pids": 4, "load": 0.82, "stateBytes": 123456, "lag": 10},
                {"name": "x-1", "ready": True, "pids": 4, "load": 0.31, "stateBytes": 65432, "lag": 0},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Running",
                    "message": "2/2 instances own pids",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    }
    kube.kubectl(
        "patch",
        "-n",
        namespace,
        "joinpipeline/x",
        "--subresource=status",
        "--type=merge",
        "-p",
        yaml.safe_dump(status),
    )
    obj = _getpipeline_manifest(kube, namespace, "x")
    assert obj["status"]["epoch"] == 7
    assert obj["status"]["assignment"][1] == {"instance": "x-1", "pids": "4-7", "count": 4}

    scale = _scale(kube, namespace, "x")
    assert scale["status"] == {"replicas": 2, "selector": status["status"]["selector"]}

    # A write to the main resource cannot change status.
    kube.kubectl("patch", "-n", namespace, "joinpipeline/x", "--type=merge", "-p", '{"status":{"epoch":99}}')
    assert _getpipeline_manifest(kube, namespace, "x")["status"]["epoch"] == 7

    table = kube.kubectl("get", "-n", namespace, "joinpipeline/x").stdout.split("\n")
    assert table[0].split() == [
        "NAME", "REPLICAS", "READY", "PARTITIONS", "WINDOW", "POLICY", "EPOCH", "MOVES", "TUPLES/S", "LAG",
        "STATUS", "AGE",
    ]  # fmt: skip
    assert table[1].split()[:11] == ["x", "2", "2", "8", "10000", "flux", "7", "1", "1234.5", "10", "Running"]

    bad_status = '{"status":{"conditions":[{"type":"Ready","status":"Maybe"}]}}'
    out = kube.kubectl(
        "patch", "-n", namespace, "joinpipeline/x", "--subresource=status", "--type=merge", "-p", bad_status,
        check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "status.conditions[0].status" in out.stderr


def test_short_name_and_category(kube: KubeCluster, namespace: str, crd: None) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("x"))
    assert (
        kube.kubectl("get", "-n", namespace, "jp", "-o", "name").stdout.strip()
        == "joinpipeline.fluxjoin.io/x"
    )
    assert (
        "joinpipeline.fluxjoin.io/x" in kube.kubectl("get", "-n", namespace, "fluxjoin", "-o", "name").stdout
    )


def test_pipeline_name_length_is_limited(kube: KubeCluster, namespace: str, crd: None) -> None:
    out = kube.kubectl(
        "apply", "-n", namespace, "-f", "-", input_text=pipeline_manifest("p" * 41), check=False
    )
    assert out.returncode != 0
    assert "metadata.name must be at most 40 characters" in out.stderr


# --- RBAC: what the operator's service account may and may not do ---

ALLOWED = [
    ["list", "joinpipelines.fluxjoin.io"],
    ["watch", "joinpipelines.fluxjoin.io"],
    ["patch", "joinpipelines.fluxjoin.io"],
    ["patch", "joinpipelines.fluxjoin.io", "--subresource=status"],
    ["update", "joinpipelines.fluxjoin.io", "--subresource=finalizers"],
    ["get", "statefulsets.apps"],
    ["create", "statefulsets.apps"],
    ["patch", "statefulsets.apps"],
    ["get", "services"],
    ["create", "services"],
    ["patch", "services"],
    ["get", "configmaps"],
    ["create", "configmaps"],
    ["patch", "configmaps"],
    ["get", "poddisruptionbudgets.policy"],
    ["create", "poddisruptionbudgets.policy"],
    ["patch", "poddisruptionbudgets.policy"],
    ["list", "pods"],
    ["list", "persistentvolumeclaims"],
    ["delete", "persistentvolumeclaims"],
    ["create", "leases.coordination.k8s.io"],
    ["get", "leases.coordination.k8s.io/fj-fluxjoin-operator"],
    ["patch", "leases.coordination.k8s.io/fj-fluxjoin-operator"],
    ["create", "events"],
]
"""Exactly what the operator calls (`controller.k8s.api`, `controller.k8s.lease`); every other verb is
denied, those below checked by name."""
DENIED_IN_NAMESPACE = [
    ["get", "secrets"],
    ["get", "joinpipelines.fluxjoin.io"],
    ["update", "joinpipelines.fluxjoin.io"],
    ["update", "joinpipelines.fluxjoin.io", "--subresource=status"],
    ["update", "joinpipelines.fluxjoin.io", "--subresource=scale"],
    ["list", "statefulsets.apps"],
    ["update", "statefulsets.apps"],
    ["delete", "statefulsets.apps"],
    ["delete", "configmaps"],
    ["list", "configmaps"],
    ["get", "pods"],
    ["watch", "pods"],
    ["create", "pods"],
    ["delete", "pods"],
    ["get", "persistentvolumeclaims"],
    ["create", "persistentvolumeclaims"],
    ["delete", "joinpipelines.fluxjoin.io"],
    ["create", "joinpipelines.fluxjoin.io"],
    ["update", "leases.coordination.k8s.io/fj-fluxjoin-operator"],
    ["update", "leases.coordination.k8s.io/someone-elses-lease"],
    ["delete", "leases.coordination.k8s.io"],
    ["patch", "events"],
    ["create", "events.events.k8s.io"],
    ["create", "roles.rbac.authorization.k8s.io"],
    ["create", "rolebindings.rbac.authorization.k8s.io"],
    ["create", "pods/exec"],
    ["create", "serviceaccounts/token"],
]
DENIED_CLUSTER_WIDE = [
    ["list", "nodes"],
    ["create", "clusterroles.rbac.authorization.k8s.io"],
    ["create", "clusterrolebindings.rbac.authorization.k8s.io"],
    ["list", "namespaces"],
    ["create", "customresourcedefinitions.apiextensions.k8s.io"],
    ["list", "joinpipelines.fluxjoin.io", "--all-namespaces"],
    ["list", "statefulsets.apps", "--all-namespaces"],
]


def _can_i(kube: KubeCluster, namespace: str, sa: str, args: list[str], ns: str | None = None) -> str:
    out = kube.kubectl(
        "auth",
        "can-i",
        *args,
        "-n",
        ns or namespace,
        f"--as=system:serviceaccount:{namespace}:{sa}",
        check=False,
    )
    return out.stdout.strip()


def test_operator_rbac_is_least_privilege(kube: KubeCluster, namespace: str, crd: None) -> None:
    kube.helm("install", "fj", str(CHART), "-n", namespace)
    sa = "fj-fluxjoin-operator"
    answers = {
        " ".join(a): _can_i(kube, namespace, sa, a)
        for a in ALLOWED + DENIED_IN_NAMESPACE + DENIED_CLUSTER_WIDE
    }
    assert {k: v for k, v in answers.items() if k in {" ".join(a) for a in ALLOWED}} == {
        " ".join(a): "yes" for a in ALLOWED
    }
    assert {k: v for k, v in answers.items() if k not in {" ".join(a) for a in ALLOWED}} == {
        " ".join(a): "no" for a in DENIED_IN_NAMESPACE + DENIED_CLUSTER_WIDE
    }
    # Nothing in any other namespace, not even what it may do in its own.
    for other_ns_args in (
        ["get", "secrets"],
        ["patch", "statefulsets.apps"],
        ["create", "leases.coordination.k8s.io"],
    ):
        assert _can_i(kube, namespace, sa, other_ns_args, ns="kube-system") == "no"


def test_operator_identity_can_write_status_but_not_read_secrets(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    """Real requests as the service account, not only `can-i`."""
    kube.helm("install", "fj", str(CHART), "-n", namespace, *VALUE_SETS["external-kafka"])
    subject = f"system:serviceaccount:{namespace}:fj-fluxjoin-operator"
    as_sa = f"--as={subject}"
    # As the operator writes status: a merge patch, with no read before it (kubectl would get first).
    as_operator = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    as_operator.set_default_header("Impersonate-User", subject)
    kubernetes.client.CustomObjectsApi(as_operator).patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "fj-fluxjoin", {"status": {"epoch": 1}},
        _content_type="application/merge-patch+json",
    )  # fmt: skip
    assert _getpipeline_manifest(kube, namespace, "fj-fluxjoin")["status"]["epoch"] == 1
    lease = yaml.safe_dump(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "fj-fluxjoin-operator"},
            "spec": {"holderIdentity": "fj-fluxjoin-operator-0", "leaseDurationSeconds": 15},
        }
    )
    kube.kubectl("create", "-n", namespace, "-f", "-", as_sa, input_text=lease)
    kube.kubectl("annotate", "-n", namespace, "lease/fj-fluxjoin-operator", "renewed=1", as_sa)  # get, patch
    out = kube.kubectl("get", "secrets", "-n", namespace, as_sa, check=False)
    assert out.returncode != 0
    assert "Forbidden" in out.stderr


# --- rendered and plain manifests, validated by the server ---


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_template_passes_server_side_dry_run(
    kube: KubeCluster, namespace: str, crd: None, value_set: str
) -> None:
    rendered = kube.helm("template", "fj", str(CHART), "-n", namespace, *VALUE_SETS[value_set]).stdout
    out = kube.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-", input_text=rendered
    )
    assert "(server dry run)" in out.stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(rendered) if d}
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment"} <= kinds


def test_kustomize_passes_server_side_dry_run(
    kube: KubeCluster, namespace: str, crd: None, tmp_path: Path
) -> None:
    overlay = _relative_overlay(tmp_path, namespace)
    built = kube.kubectl("kustomize", str(overlay)).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    binding = next(d for d in docs if d["kind"] == "RoleBinding")
    assert binding["subjects"][0]["namespace"] == namespace
    out = kube.kubectl(
        "apply", "--server-side", "--dry-run=server", "--validate=strict", "-f", "-", input_text=built
    )
    assert (
        "customresourcedefinition.apiextensions.k8s.io/joinpipelines.fluxjoin.io serverside-applied"
        in out.stdout
    )
    assert "deployment.apps/fluxjoin-operator serverside-applied (server dry run)" in out.stdout

    example = REPO / "k8s" / "examples" / "joinpipeline.yaml"
    out = kube.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", str(example))
    assert "joinpipeline.fluxjoin.io/demo created (server dry run)" in out.stdout


def test_kustomize_base_installs_for_real(kube: KubeCluster, crd: None) -> None:
    """`kubectl apply --server-side -k k8s/` into namespace fluxjoin, as docs/kubernetes.md says."""
    kube.kubectl("create", "namespace", "fluxjoin", check=False)
    kube.kubectl("apply", "--server-side", "-k", str(REPO / "k8s"))
    apps = kubernetes.client.AppsV1Api(kube.api_client)
    deployment = apps.read_namespaced_deployment("fluxjoin-operator", "fluxjoin")
    container = _plain(kube, deployment)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLUXJOIN_INSTANCE_IMAGE"] == container["image"] == "fluxjoin:0.1.0"
    assert (
        _can_i(
            kube,
            "fluxjoin",
            "fluxjoin-operator",
            ["patch", "joinpipelines.fluxjoin.io", "--subresource=status"],
        )
        == "yes"
    )


def test_signing_makes_the_controllers_key_once_and_only_the_operator_holds_it(
    kube: KubeCluster, namespace: str, crd: None
) -> None:
    """`signing.enabled`: a Secret with the controller's key, kept by `helm upgrade`, mounted by the
    operator alone; a Service where instance pods ask for certificates; the one cluster-wide verb the
    operator gains (creating TokenReviews), and none without signing."""
    from pipeline.signing import ISSUER_ENV, KEY_ENV, TRUST_ENV

    sa = "fj-fluxjoin-operator"
    assert _can_i(kube, namespace, sa, ["create", "tokenreviews.authentication.k8s.io"]) == "no"
    kube.helm("install", "fj", str(CHART), "-n", namespace, "--set", "signing.enabled=true")
    core: Any = kubernetes.client.CoreV1Api(kube.api_client)
    key = core.read_namespaced_secret("fj-fluxjoin-signing", namespace).data["controller.key"]
    assert _can_i(kube, namespace, sa, ["create", "tokenreviews.authentication.k8s.io"]) == "yes"
    assert _can_i(kube, namespace, sa, ["get", "secrets"]) == "no", "it reads its key as a file"
    kube.helm("upgrade", "fj", str(CHART), "-n", namespace, "--reuse-values")
    assert core.read_namespaced_secret("fj-fluxjoin-signing", namespace).data["controller.key"] == key

    apps = kubernetes.client.AppsV1Api(kube.api_client)
    operator = _plain(kube, apps.read_namespaced_deployment("fj-fluxjoin-operator", namespace))
    pod = operator["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env[KEY_ENV] == env[TRUST_ENV] == f"{mounts['signing']}/controller.key"
    assert env[ISSUER_ENV] == f"http://fj-fluxjoin-operator.{namespace}.svc:9108"
    service = core.read_namespaced_service("fj-fluxjoin-operator", namespace)
    assert service.spec.selector == operator["spec"]["selector"]["matchLabels"]
    assert key not in json.dumps(operator)
