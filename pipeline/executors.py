"""An instance's Spark executors as Kubernetes pods: the driver's settings, and the executor's command.

With `instance.executors` set, an instance pod is a Spark driver in client mode whose master is the
pod's own API server (`k8s://https://...`): Spark's Kubernetes backend creates `count` executor pods
from the same image, replaces one that is lost, and reruns its tasks. What Spark needs to know about the
pod it runs in (its name, address, node, image, checkpoint volume) comes from the environment the
operator gives instance pods in this mode (`controller.k8s.manifests`), one variable each, named here.

The driver is reached at its pod's IP on fixed ports (`DRIVER_PORT`, `BLOCK_MANAGER_PORT`), so no
Service is needed and the pod can declare them. Executors mount the instance's own checkpoint volume at
the same path as the driver (decision 0071): the state store's files are written by the tasks, the offset
and commit logs by the driver, and both must be one directory. The volume being ReadWriteOnce, the
executors run on the driver's node (a node selector).

An executor pod's container gets the argument `executor` from Spark, and the image's entry point is the
`fluxjoin` command: `fluxjoin executor` runs the JVM as Spark's own images do (`executor_command`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from pipeline.config import ExecutorsConfig

POD_NAME_ENV = "FLUXJOIN_POD_NAME"
NAMESPACE_ENV = "FLUXJOIN_NAMESPACE"
POD_IP_ENV = "FLUXJOIN_POD_IP"
NODE_NAME_ENV = "FLUXJOIN_NODE_NAME"
IMAGE_ENV = "FLUXJOIN_IMAGE"
PULL_POLICY_ENV = "FLUXJOIN_IMAGE_PULL_POLICY"
CLAIM_ENV = "FLUXJOIN_CHECKPOINT_CLAIM"
TEMPLATE_ENV = "FLUXJOIN_EXECUTOR_TEMPLATE"
DRIVER_ENV = (POD_NAME_ENV, NAMESPACE_ENV, POD_IP_ENV, NODE_NAME_ENV, IMAGE_ENV, PULL_POLICY_ENV, CLAIM_ENV,
              TEMPLATE_ENV)  # fmt: skip
"""What a driver pod must be told (besides the API server's address, which every pod has)."""

DRIVER_PORT = 7078
"""Where executors reach the driver's scheduler (Spark's own images use the same)."""
BLOCK_MANAGER_PORT = 7079
"""The block manager's port, driver's and executors' alike: shuffle blocks and task results travel here."""
EXECUTOR_BACKEND = "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend"


class NotInAPod(RuntimeError):
    """`instance.executors` is set but the process lacks what only an operator-made pod has."""


def check_pod(env: Mapping[str, str]) -> None:
    """Raise `NotInAPod` naming what `env` lacks of a driver pod's: an instance started by hand with
    executors set would otherwise fail deep in Spark's Kubernetes client, after its start."""
    missing = [
        v for v in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", *DRIVER_ENV) if not env.get(v)
    ]
    if missing:
        raise NotInAPod(
            "instance.executors needs a pod made by the fluxjoin operator (it runs executor pods); "
            f"missing: {', '.join(missing)}"
        )


def driver_conf(
    executors: ExecutorsConfig, work_dir: str, java_options: str, env: Mapping[str, str]
) -> dict[str, str]:
    """Spark's settings for a driver in the pod `env` describes, whose executors are pods; `NotInAPod`
    as `check_pod` says."""
    check_pod(env)
    host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
    host = f"[{host}]" if ":" in host else host
    volume = "spark.kubernetes.executor.volumes.persistentVolumeClaim.checkpoint"
    conf = {
        "spark.master": f"k8s://https://{host}:{port}",
        "spark.submit.deployMode": "client",
        "spark.executor.instances": str(executors.count),
        "spark.executor.cores": str(executors.cores),
        "spark.executor.memory": executors.memory,
        "spark.executor.extraJavaOptions": java_options,
        "spark.kubernetes.namespace": env[NAMESPACE_ENV],
        # The executors are owned by the driver's pod: a driver pod that goes takes its executors along.
        # Spark first waits a second for that pod to be Ready, which it is only once its query has run a
        # batch (decision 0043), and logs the wait's end as an error: harmless, it goes on.
        "spark.kubernetes.driver.pod.name": env[POD_NAME_ENV],
        "spark.kubernetes.executor.podNamePrefix": env[POD_NAME_ENV],
        "spark.kubernetes.container.image": env[IMAGE_ENV],
        "spark.kubernetes.container.image.pullPolicy": env[PULL_POLICY_ENV],
        "spark.kubernetes.executor.podTemplateFile": env[TEMPLATE_ENV],
        "spark.kubernetes.executor.podTemplateContainerName": "executor",
        # Spark's configuration files go to executors in a ConfigMap, and on exit it deletes a driver
        # Service and the claims it made for executors; fluxjoin has no such files, Service or claims,
        # and its pods may touch none of them (the instances' Role is pods only).
        "spark.kubernetes.executor.disableConfigMap": "true",
        "spark.kubernetes.driver.service.deleteOnTermination": "false",
        "spark.kubernetes.driver.ownPersistentVolumeClaim": "false",
        "spark.driver.host": env[POD_IP_ENV],
        "spark.driver.port": str(DRIVER_PORT),
        "spark.driver.blockManager.port": str(BLOCK_MANAGER_PORT),
        "spark.blockManager.port": str(BLOCK_MANAGER_PORT),
        f"{volume}.options.claimName": env[CLAIM_ENV],
        f"{volume}.mount.path": work_dir,
        "spark.kubernetes.executor.node.selector.kubernetes.io/hostname": env[NODE_NAME_ENV],
        # No token or CA named: Spark's client takes the pod's service account token and CA itself, as
        # any in-cluster client does.
    }
    if executors.cpu_request is not None:
        conf["spark.kubernetes.executor.request.cores"] = executors.cpu_request
    return conf


def executor_command(env: Mapping[str, str], jars: Path) -> list[str]:
    """The JVM command of an executor pod, from the variables Spark's Kubernetes backend sets on it, as
    the entry point of Spark's own images builds it: the options Spark passes (`SPARK_JAVA_OPT_<i>`, in
    order), the heap, the jars of the PySpark distribution (`jars`), the backend and its arguments.
    KeyError names a variable Spark did not set: the container was not started by Spark."""
    options = sorted(
        (
            (int(k.removeprefix("SPARK_JAVA_OPT_")), v)
            for k, v in env.items()
            if k.startswith("SPARK_JAVA_OPT_")
        ),
    )
    memory = env["SPARK_EXECUTOR_MEMORY"]
    return [
        "java",
        *(v for _, v in options),
        f"-Xms{memory}",
        f"-Xmx{memory}",
        "-cp",
        f"{jars}/*",
        EXECUTOR_BACKEND,
        "--driver-url", env["SPARK_DRIVER_URL"],
        "--executor-id", env["SPARK_EXECUTOR_ID"],
        "--cores", env["SPARK_EXECUTOR_CORES"],
        "--app-id", env["SPARK_APPLICATION_ID"],
        "--hostname", env["SPARK_EXECUTOR_POD_IP"],
        "--resourceProfileId", env["SPARK_RESOURCE_PROFILE_ID"],
        "--podName", env["SPARK_EXECUTOR_POD_NAME"],
    ]  # fmt: skip
