"""The objects the operator owns for a pipeline, rendered from its spec.

Pure: every function here takes observed values and returns plain JSON-ready dicts (the shape the API
server sends and accepts), so that the reconcile loop (`controller.k8s.reconciler`) only compares and
sends them, and so that re-rendering from unchanged inputs gives an identical object (no write is needed).

Owned objects, all named after the pipeline and labelled with `fluxjoin.io/pipeline`:
- a StatefulSet of join instances (pod `<name>-<ordinal>` is instance `<name>-<ordinal>`), each with a
  PersistentVolumeClaim `checkpoint-<name>-<ordinal>` for its Spark checkpoint;
- a ConfigMap holding the instances' configuration file, mounted into every instance pod (and with
  `spec.instance.executors`, the template of their executor pods, which Spark creates);
- a headless Service giving the instance pods stable DNS names;
- a PodDisruptionBudget letting a voluntary disruption (a node drain) take one instance pod at a time.

This module must not call the API server or the `PidMover`; it knows the CRD's field names and nothing
about how a move is carried out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from controller.k8s.resource import CaSecret, ClientCertSecret, KafkaSecurity, PasswordSecret
from controller.k8s.spec import API_VERSION, FIELD_MANAGER, KIND, WORK_DIR, InstanceSettings, PipelineSpec
from controller.scaling import ordinal_of
from pipeline import executors
from pipeline.config import Config
from pipeline.signing import ISSUER_ENV, TOKEN_AUDIENCE, TOKEN_ENV, TRUST_ENV

PIPELINE_LABEL = "fluxjoin.io/pipeline"
SPEC_HASH_ANNOTATION = "fluxjoin.io/spec-hash"
CONFIG_HASH_ANNOTATION = "fluxjoin.io/config-hash"
CHECKPOINT_VOLUME = "checkpoint"
CONFIG_VOLUME = "config"
CONFIG_DIR = "/etc/fluxjoin"
CONFIG_FILE = "instance.yaml"
CONTROLLER_KEY_FILE = "controller.pub"
STARTUP_ALLOWANCE_S = 600
"""How long an instance pod may take from its start until its query serves (/readyz) before the kubelet
restarts it: a JVM, a Spark session and a first batch, 20-60 s on a core, several minutes under a CPU
limit of a fraction of a core. Liveness is checked only from then on."""


def selector_labels(pipeline: str) -> dict[str, str]:
    """The labels that select a pipeline's instance pods (and their checkpoint volumes)."""
    return {
        "app.kubernetes.io/name": "fluxjoin",
        "app.kubernetes.io/component": "instance",
        PIPELINE_LABEL: pipeline,
    }


def selector_string(pipeline: str) -> str:
    """The selector in `kubectl -l` form, for status.selector (the scale subresource's labelSelectorPath)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pipeline).items()))


def _labels(pipeline: str) -> dict[str, str]:
    return {
        **selector_labels(pipeline),
        "app.kubernetes.io/part-of": "fluxjoin",
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
    }


def owner_reference(spec: PipelineSpec) -> dict[str, Any]:
    """Makes the pipeline the controller of what it owns (cluster garbage collection, `kubectl describe`)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _with_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """Stamp the manifest with a hash of everything but spec.replicas (a ConfigMap's data included), so a
    changed object is seen by comparing one annotation, and a scale step alone by comparing replicas."""
    content = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata", "spec")}
    if "spec" in manifest:
        content["spec"] = {k: v for k, v in manifest["spec"].items() if k != "replicas"}
    manifest["metadata"].setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = _digest(
        [manifest["metadata"], content]
    )
    return manifest


def _metadata(spec: PipelineSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": _labels(spec.name),
        "ownerReferences": [owner_reference(spec)],
    }


def instance_config(spec: PipelineSpec) -> dict[str, Any]:
    """The configuration every instance pod of the pipeline reads from its ConfigMap (`--config`).

    One document in the schema of `pipeline.config` rather than `--set key=value` arguments: an
    argument's value is read as YAML, so a pipeline named `123` or a stream named `on` reached the
    instance as a number or a boolean and the pods crash-looped, while the operator, which builds its
    configuration directly, carried on. A YAML file written by `yaml.safe_dump` quotes such strings.

    The pod template is shared by all ordinals and must not change when pids move (a change would restart
    every instance), so this carries the pipeline's configuration but no pids: an instance learns the
    pids it owns from the control topic. `instances=1` because each process is one instance; how many run
    is the StatefulSet's business. Raises ValueError (pydantic's) when the configuration is invalid, so
    the pipeline reports it instead of its pods crash-looping.
    """
    document: dict[str, Any] = {
        "pipeline": spec.topic_prefix,
        "bootstrap": spec.bootstrap_servers,
        "streams": list(spec.streams),
        "window_ms": spec.window_ms,
        "allowed_lateness_ms": spec.allowed_lateness_ms,
        "partitions": spec.partitions,
        "instances": 1,
        "instance": spec.instance.model_dump(exclude_none=True),
        "topics": spec.topics.model_dump(exclude_none=True),
    }
    Config.model_validate(document)
    return document


def config_map(
    spec: PipelineSpec, controller_public_key: str | None = None, pull_secrets: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The ConfigMap holding the instances' configuration file (`CONFIG_FILE`), with signing on the
    controller's public key they trust (`CONTROLLER_KEY_FILE`), and with executors the executor pods'
    template (`EXECUTOR_TEMPLATE_FILE`, pulled with `pull_secrets`)."""
    text = (
        f"# fluxjoin instance configuration of JoinPipeline {spec.namespace}/{spec.name}, written by the\n"
        "# operator from the pipeline's spec: edit the JoinPipeline, not this file.\n"
    ) + yaml.safe_dump(instance_config(spec), sort_keys=False)
    data = {CONFIG_FILE: text} | (
        {CONTROLLER_KEY_FILE: controller_public_key} if controller_public_key else {}
    )
    if spec.instance.executors is not None:
        data[EXECUTOR_TEMPLATE_FILE] = yaml.safe_dump(
            executor_pod_template(spec, pull_secrets), sort_keys=False
        )
    return _with_hash({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(spec), "data": data})


EXECUTOR_TEMPLATE_FILE = "executor-pod.yaml"
POD_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Of every pod the operator has run: instance and executor pods alike (Pod Security `restricted`)."""
CONTAINER_SECURITY_CONTEXT = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def executor_pod_template(spec: PipelineSpec, pull_secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    """The pod template Spark's Kubernetes backend builds each executor pod on (`pipeline.executors`).

    Spark adds the image, the command's variables, resources, ports, its local directories, the
    checkpoint volume and the owner reference to the driver's pod; the template brings what fluxjoin's
    pods have besides: the same security context as the instance pods, a writable /tmp, the Kafka
    credentials (the tasks read the input and report to Kafka), and no API token (executors never call
    the API server). Its labels say which pipeline the executor works for, and that it is no instance,
    so that no selector of the instances' picks it up."""
    kafka_env, kafka_volume = kafka_credentials(spec.kafka_security)
    container: dict[str, Any] = {
        "name": "executor",
        "env": kafka_env,
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": POD_SECURITY_CONTEXT,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    if kafka_volume is not None:
        pod["volumes"].append(kafka_volume)
        container["volumeMounts"].append(
            {"name": kafka_volume["name"], "mountPath": KAFKA_CREDENTIALS_DIR, "readOnly": True}
        )
    if pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    labels = {**_labels(spec.name), "app.kubernetes.io/component": "executor"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": labels}, "spec": pod}


def executor_mode(
    spec: PipelineSpec, settings: InstanceSettings, image: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """What an instance pod adds to be the Spark driver of executor pods (`pipeline.executors`): the
    environment that says where it runs, the driver's ports, and the pod's service account with its
    token (Spark's Kubernetes client creates, watches and deletes the executor pods). Nothing without
    `spec.instance.executors`; ValueError when no service account for it was given to the operator."""
    if spec.instance.executors is None:
        return [], [], {}
    if not settings.executor_service_account:
        raise ValueError(
            "spec.instance.executors needs the instances' ServiceAccount, which may create pods: install "
            "the chart with executors.enabled=true (or run the operator with --instance-service-account)"
        )

    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    env = [
        field(executors.POD_IP_ENV, "status.podIP"),
        field(executors.NODE_NAME_ENV, "spec.nodeName"),
        {"name": executors.IMAGE_ENV, "value": image},
        {"name": executors.PULL_POLICY_ENV, "value": settings.pull_policy},
        # The StatefulSet's claim of this pod: its template names the volume, the claim adds the pod's name.
        {"name": executors.CLAIM_ENV, "value": f"{CHECKPOINT_VOLUME}-$({executors.POD_NAME_ENV})"},
        {"name": executors.TEMPLATE_ENV, "value": f"{CONFIG_DIR}/{EXECUTOR_TEMPLATE_FILE}"},
    ]
    ports = [
        {"name": "spark-driver", "containerPort": executors.DRIVER_PORT, "protocol": "TCP"},
        {"name": "spark-blocks", "containerPort": executors.BLOCK_MANAGER_PORT, "protocol": "TCP"},
    ]
    pod = {"serviceAccountName": settings.executor_service_account, "automountServiceAccountToken": True}
    return env, ports, pod


SIGNING_TOKEN_DIR = "/var/run/secrets/fluxjoin"
"""Where an instance pod finds its service account token for the audience `fluxjoin`."""


def signing(settings: InstanceSettings) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The environment and the token volume with which an instance pod gets its signing certificate
    from the operator (`pipeline.signing.request_certificate`) and checks what it reads against the
    controller's key; nothing while the operator signs nothing (decision 0064)."""
    if not settings.signing_issuer:
        return [], None
    env = [
        {"name": ISSUER_ENV, "value": settings.signing_issuer},
        {"name": TOKEN_ENV, "value": f"{SIGNING_TOKEN_DIR}/token"},
        {"name": TRUST_ENV, "value": f"{CONFIG_DIR}/{CONTROLLER_KEY_FILE}"},
    ]
    token = {"path": "token", "audience": TOKEN_AUDIENCE, "expirationSeconds": 600}
    volume = {"name": "signing-token", "projected": {"sources": [{"serviceAccountToken": token}]}}
    return env, volume


def instance_args(settings: InstanceSettings) -> list[str]:
    """`fluxjoin instance` arguments for every pod of the StatefulSet: its name, the mounted configuration
    file and the metrics port the pod's probes and scrape annotations use."""
    return [
        "instance",
        "--name",
        "$(FLUXJOIN_POD_NAME)",
        "--config",
        f"{CONFIG_DIR}/{CONFIG_FILE}",
        "--metrics-port",
        str(settings.metrics_port),
    ]


def _probes() -> dict[str, Any]:
    """Startup, liveness and readiness of an instance container, on its metrics port (`pipeline.health`).

    The startup probe waits for /readyz (the query has run a batch) for up to `STARTUP_ALLOWANCE_S`;
    until it passes, liveness is not checked. From then on /healthz fails once the query has made no
    progress for the instance's stall timeout, and three failures 10 s apart restart the container.
    /readyz gates a rolling update, which replaces the next pod only when this one serves again.
    """
    period_s = 5
    return {
        "startupProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": STARTUP_ALLOWANCE_S // period_s,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": period_s,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


KAFKA_CREDENTIALS_DIR = "/etc/fluxjoin/kafka"
"""Where an instance pod finds the Kafka credentials of spec.kafka.security, as files."""


def kafka_credentials(security: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The `FLUXJOIN_KAFKA_*` environment (`pipeline.kafka_client`) and the volume of Secret files that
    log a pod in to Kafka as spec.kafka.security says (the chart renders the same for the operator and
    the generator: `fluxjoin.kafkaCredentials`). The password and keys reach the pod only as files of
    a projected Secret volume: never in the pod's spec, its arguments or its environment."""
    env: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []

    def put(variable: str, value: str) -> None:
        env.append({"name": f"FLUXJOIN_KAFKA_{variable}", "value": value})

    def secret_file(variable: str, secret_name: str | None, key: str, path: str) -> None:
        if secret_name:
            items.append({"secret": {"name": secret_name, "items": [{"key": key, "path": path}]}})
            put(variable, f"{KAFKA_CREDENTIALS_DIR}/{path}")

    given = KafkaSecurity.model_validate(security)  # its defaults: the protocol, the Secrets' keys
    if given.protocol == "PLAINTEXT":
        return env, None
    put("SECURITY_PROTOCOL", given.protocol)
    if given.sasl_mechanism:
        put("SASL_MECHANISM", given.sasl_mechanism)
    if given.username:
        put("SASL_USERNAME", given.username)
    password = given.password_secret or PasswordSecret()
    secret_file("SASL_PASSWORD_FILE", password.name, password.key, "password")
    ca = given.ca_secret or CaSecret()
    secret_file("SSL_CA_FILE", ca.name, ca.key, "ca.crt")
    client = given.client_cert_secret or ClientCertSecret()
    secret_file("SSL_CERT_FILE", client.name, client.cert_key, "user.crt")
    secret_file("SSL_KEY_FILE", client.name, client.key_key, "user.key")
    volume = (
        {"name": "kafka-credentials", "projected": {"sources": items, "defaultMode": 0o440}}
        if items
        else None
    )
    return env, volume


def statefulset(spec: PipelineSpec, settings: InstanceSettings, replicas: int) -> dict[str, Any]:
    """The instance StatefulSet with `replicas` pods; ValueError when no image is known."""
    image = spec.image or settings.image
    if not image:
        raise ValueError(
            "no image for the join instances: set spec.image or run the operator with --instance-image"
        )
    labels = _labels(spec.name)
    annotations = (
        {"prometheus.io/scrape": "true", "prometheus.io/port": str(settings.metrics_port),
         "prometheus.io/path": "/metrics"}
        if settings.scrape_annotations else {}
    )  # fmt: skip
    # The file's content changes no argument: its hash in the template rolls the pods when it changes.
    annotations[CONFIG_HASH_ANNOTATION] = _digest(
        config_map(spec, settings.controller_public_key, settings.pull_secrets)["data"]
    )
    kafka_env, kafka_volume = kafka_credentials(spec.kafka_security)
    signing_env, token_volume = signing(settings)
    driver_env, driver_ports, driver_pod = executor_mode(spec, settings, image)
    container: dict[str, Any] = {
        "name": "instance",
        "image": image,
        "imagePullPolicy": settings.pull_policy,
        "args": instance_args(settings),
        "env": [
            {"name": executors.POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": executors.NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *kafka_env,
            *signing_env,
            *driver_env,
        ],
        "ports": [
            {"name": "metrics", "containerPort": settings.metrics_port, "protocol": "TCP"},
            *driver_ports,
        ],
        **_probes(),
        "resources": dict(spec.resources),
        "securityContext": CONTAINER_SECURITY_CONTEXT,
        "volumeMounts": [
            {"name": CHECKPOINT_VOLUME, "mountPath": WORK_DIR},
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        # A draining instance must finish before the kubelet's SIGKILL: its timeout and a margin to stop.
        "terminationGracePeriodSeconds": int(max(60, spec.drain_timeout_s + 30)),
        "securityContext": POD_SECURITY_CONTEXT,
        "containers": [container],
        "volumes": [
            {"name": CONFIG_VOLUME, "configMap": {"name": spec.name}},
            {"name": "tmp", "emptyDir": {}},
        ],
        **driver_pod,
    }
    if kafka_volume is not None:
        pod_spec["volumes"].append(kafka_volume)
        container["volumeMounts"].append(
            {"name": kafka_volume["name"], "mountPath": KAFKA_CREDENTIALS_DIR, "readOnly": True}
        )
    if token_volume is not None:
        pod_spec["volumes"].append(token_volume)
        container["volumeMounts"].append(
            {"name": token_volume["name"], "mountPath": SIGNING_TOKEN_DIR, "readOnly": True}
        )
    if settings.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in settings.pull_secrets]
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": spec.checkpoint_size}},
    }
    if spec.storage_class:
        claim_spec["storageClassName"] = spec.storage_class
    return _with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _metadata(spec),
            "spec": {
                "replicas": replicas,
                "serviceName": spec.name,
                # Pods of a scale step start together; the operator, not pod order, decides who owns what.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector_labels(spec.name)},
                # A removed instance's checkpoint holds offsets of pids it no longer owns: never reuse it.
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Delete"},
                "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
                "volumeClaimTemplates": [
                    {"metadata": {"name": CHECKPOINT_VOLUME, "labels": labels}, "spec": claim_spec}
                ],
            },
        }
    )


def service(spec: PipelineSpec, settings: InstanceSettings) -> dict[str, Any]:
    """The headless Service that gives each instance pod a stable DNS name (the StatefulSet's serviceName)."""
    return _with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(spec),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": selector_labels(spec.name),
                "ports": [
                    {
                        "name": "metrics",
                        "port": settings.metrics_port,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    }
                ],
            },
        }
    )


def pod_disruption_budget(spec: PipelineSpec) -> dict[str, Any]:
    """At most one instance pod down at a time by a voluntary disruption (a node drain, an eviction).

    Each instance down pauses its pids until it is back or the controller recovers them elsewhere, and
    every recovery replays input; one at a time keeps that to the pids of one instance. A pod that is
    not ready (crash-looping, or still starting) may always be evicted (`AlwaysAllow`): it serves
    nothing, and would otherwise block the drain.
    """
    return _with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(spec),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": selector_labels(spec.name)},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    )


def checkpoint_claim_ordinal(pipeline: str, claim_name: str) -> int | None:
    """The ordinal of a checkpoint volume `checkpoint-<pipeline>-<ordinal>`, None for any other claim."""
    prefix = f"{CHECKPOINT_VOLUME}-"
    if not claim_name.startswith(prefix):
        return None
    try:
        return ordinal_of(pipeline, claim_name[len(prefix) :])
    except ValueError:
        return None
