"""The JoinPipeline's one schema (`controller.k8s.resource`): the CRD is generated from it, each of its
defaults is the one `pipeline.config` or a policy defines, and the operator reads pipelines through it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from controller.assignment import HandoffMode
from controller.k8s.crd import (
    CHART_PIPELINE_FIELDS,
    CRD_FILES,
    VALUES_SCHEMA,
    chart_pipeline_schema,
    crd,
    generated,
    main,
    structural,
)
from controller.k8s.resource import (
    FluxMemorySettings,
    FluxSettings,
    InstanceSpec,
    JoinPipelineSpec,
    MemorySettings,
    PolicySpec,
    TopicsSpec,
    settings_section,
)
from controller.k8s.spec import WORK_DIR, PipelineSpec
from controller.policies import POLICIES
from pipeline.config import Config, InstanceConfig, TopicsConfig

REPO = Path(__file__).resolve().parents[2]
META = {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 2}


def _spec_schema() -> dict[str, Any]:
    schema: dict[str, Any] = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


# --- the CRD is generated ---


@pytest.mark.parametrize("path", [*CRD_FILES, VALUES_SCHEMA], ids=str)
def test_each_generated_file_is_as_generated(path: Path) -> None:
    """Both copies of the CRD and the chart's values schema (its example pipeline's section)."""
    assert (REPO / path).read_text() == generated()[path], (
        f"{path} differs from the schema of controller/k8s/resource.py: change the model, not the file, "
        "and run `python -m controller.k8s.crd`"
    )


def test_the_generator_rewrites_stale_files_and_its_check_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = json.loads((REPO / VALUES_SCHEMA).read_text())
    values["properties"]["pipeline"] = {"type": "object"}
    for path, text in [*((p, "stale") for p in CRD_FILES), (VALUES_SCHEMA, json.dumps(values))]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "differs" in capsys.readouterr().out
    assert (tmp_path / CRD_FILES[0]).read_text() == "stale"
    assert main(["--root", str(tmp_path)]) == 0
    for path, text in generated().items():
        assert (tmp_path / path).read_text() == text
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_the_charts_schema_has_every_pipeline_value_and_no_other() -> None:
    values = yaml.safe_load((REPO / "charts/fluxjoin/values.yaml").read_text())["pipeline"]
    assert list(chart_pipeline_schema()["properties"]) == [
        "create",
        "name",
        *CHART_PIPELINE_FIELDS,
        "topicPrefix",
    ]
    assert set(values) == set(chart_pipeline_schema()["properties"])


def test_the_charts_pipeline_values_are_the_models_defaults() -> None:
    """values.yaml spells the example pipeline's settings out for its readers; each must be the model's
    default (one default, written where it is defined), but for what the chart itself chooses: the pods'
    resources and an empty StorageClass (the cluster's default)."""
    values = yaml.safe_load((REPO / "charts/fluxjoin/values.yaml").read_text())["pipeline"]
    kafka = {"bootstrapServers": "kafka:9092"}
    chart = {name: values[name] for name in CHART_PIPELINE_FIELDS}
    from_values = JoinPipelineSpec.model_validate({**chart, "kafka": kafka}).model_dump(by_alias=True)
    defaults = JoinPipelineSpec.model_validate({"kafka": kafka}).model_dump(by_alias=True)
    for name in CHART_PIPELINE_FIELDS:
        if name == "resources":
            continue
        if name == "checkpoint":
            assert from_values[name] == defaults[name] | {"storageClassName": ""}
            continue
        assert from_values[name] == defaults[name], name


def test_the_crds_columns_and_scale_name_fields_of_the_spec() -> None:
    (version,) = crd()["spec"]["versions"]
    paths = [c["jsonPath"] for c in version["additionalPrinterColumns"]]
    paths.append(version["subresources"]["scale"]["specReplicasPath"])
    for path in [p for p in paths if p.startswith(".spec.")]:
        node = _spec_schema()
        for name in path.split(".")[2:]:
            node = node["properties"][name]
        assert "type" in node, path


def test_the_spec_schema_is_structural() -> None:
    """What Kubernetes refuses in a CRD's schema, or reads otherwise than JSON Schema, is translated away."""
    text = json.dumps(_spec_schema())
    for keyword in (
        '"$ref"',
        '"$defs"',
        '"title"',
        '"allOf"',
        '{"type": "null"}',
        '"additionalProperties": false',
    ):
        assert keyword not in text, keyword

    def exclusive_bounds_are_booleans(node: Any) -> None:
        if isinstance(node, dict):
            for bound in ("exclusiveMinimum", "exclusiveMaximum"):
                assert node.get(bound, True) is True
            for value in node.values():
                exclusive_bounds_are_booleans(value)
        elif isinstance(node, list):
            for value in node:
                exclusive_bounds_are_booleans(value)

    exclusive_bounds_are_booleans(_spec_schema())


def test_the_translation_of_optional_fields_and_exclusive_bounds() -> None:
    schema = {
        "type": "object",
        "title": "T",
        "additionalProperties": False,
        "properties": {
            "absent": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "A"},
            "null": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}], "default": 3},
            "count": {"type": "integer", "exclusiveMinimum": 0},
            "share": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "$defs": {"N": {"type": "integer", "title": "N", "description": "a docstring"}},
    }
    assert structural(schema) == {
        "type": "object",
        "properties": {
            "absent": {"type": "string"},
            "null": {"type": "integer", "default": 3, "nullable": True},
            "count": {"type": "integer", "minimum": 1},
            "share": {
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
                "maximum": 1,
                "exclusiveMaximum": True,
            },
        },
    }


def test_the_crds_enums_are_what_the_operator_knows() -> None:
    properties = _spec_schema()["properties"]
    assert properties["handoffMode"]["enum"] == [m.value for m in HandoffMode]
    assert properties["policy"]["properties"]["name"]["enum"] == list(POLICIES)


# --- each default written once ---


def test_the_pipelines_defaults_and_limits_are_pipeline_configs() -> None:
    spec = JoinPipelineSpec.read({"kafka": {"bootstrapServers": "kafka:9092"}})
    config = Config()
    assert (spec.streams, spec.window_ms, spec.allowed_lateness_ms, spec.partitions, spec.replicas) == (
        config.streams,
        config.window_ms,
        config.allowed_lateness_ms,
        config.partitions,
        config.instances,
    )
    assert spec.instance.model_dump() == InstanceConfig().model_dump(include=set(InstanceSpec.model_fields))
    assert spec.kafka.topics.model_dump() == TopicsConfig().model_dump()
    pairs: list[tuple[type[BaseModel], type[BaseModel], dict[str, str]]] = [
        (JoinPipelineSpec, Config, {"replicas": "instances"}),
        (InstanceSpec, InstanceConfig, {}),
        (TopicsSpec, TopicsConfig, {}),
    ]
    for model, source, renamed in pairs:
        for name, field in model.model_fields.items():
            original = source.model_fields.get(renamed.get(name, name))
            if original is not None:
                assert field.metadata[: len(original.metadata)] == original.metadata, (model, name)


def test_policy_settings_are_the_policies_parameters_with_their_defaults() -> None:
    """Every parameter of a policy but its handoff mode (the pipeline's) is a field of spec.policy.<name>,
    defaulting to the parameters' own default; a policy without parameters has no section."""
    sections: dict[str, type[BaseModel]] = {
        "flux": FluxSettings,
        "memory": MemorySettings,
        "flux_memory": FluxMemorySettings,
    }
    for name, policy in POLICIES.items():
        params = policy.default_params()
        names = [f.name for f in dataclasses.fields(params) if f.name != "mode"]
        section = settings_section(name)
        if not names:
            assert section not in PolicySpec.model_fields
            continue
        assert PolicySpec.model_fields[section].annotation is sections[section]
        assert sorted(sections[section].model_fields) == sorted(names)
        assert sections[section]().model_dump() == {n: getattr(params, n) for n in names}


def _server_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` with the schema's defaults filled in, as the API server fills them."""
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _server_defaults(sub, value[key])
    return value


def test_the_api_servers_defaults_are_the_operators() -> None:
    """An object as the API server stores it (the CRD's defaults filled in) reads like the bare one."""
    bare = {"kafka": {"bootstrapServers": "kafka:9092"}}
    stored = _server_defaults(_spec_schema(), copy.deepcopy(bare))
    assert stored["policy"]["flux"] and stored["instance"] and stored["checkpoint"] == {"size": "5Gi"}
    assert JoinPipelineSpec.read(stored) == JoinPipelineSpec.read(bare)


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("k8s/examples/joinpipeline.yaml", lambda doc: doc["spec"]),
        (
            "charts/fluxjoin/values.yaml",
            lambda doc: {
                **{k: v for k, v in doc["pipeline"].items() if k not in ("create", "name", "topicPrefix")},
                "kafka": {"bootstrapServers": "kafka:9092"},
            },
        ),
    ],
)
def test_the_example_and_the_chart_values_spell_out_the_defaults(name: str, read: Any) -> None:
    spec = read(yaml.safe_load((REPO / name).read_text()))
    spelled_out = JoinPipelineSpec.read(spec).model_dump(exclude={"kafka", "resources", "checkpoint"})
    defaults = JoinPipelineSpec.read({"kafka": spec["kafka"]}).model_dump(
        exclude={"kafka", "resources", "checkpoint"}
    )
    assert spelled_out == defaults
    assert str(spec["checkpoint"]["size"]) == JoinPipelineSpec.read({"kafka": spec["kafka"]}).checkpoint.size


# --- the operator's reading ---


def _read(**spec: Any) -> PipelineSpec:
    return PipelineSpec.from_object(
        {"metadata": META, "spec": {"kafka": {"bootstrapServers": "kafka:9092"}, **spec}}
    )


def test_a_bare_pipeline_reads_as_the_defaults() -> None:
    assert _read() == PipelineSpec(
        name="demo",
        namespace="ns",
        uid="u-1",
        generation=2,
        streams=("A", "B", "C"),
        window_ms=10_000,
        allowed_lateness_ms=2_000,
        partitions=64,
        replicas=3,
        handoff_mode=HandoffMode.TRANSFER,
        bootstrap_servers="kafka:9092",
        topic_prefix="ns.demo",
        instance=InstanceConfig(work_dir=WORK_DIR),
        image=None,
        resources={},
        checkpoint_size="5Gi",
        storage_class=None,
        policy="flux",
        policy_settings={},
        heartbeat_timeout_s=10.0,
        restart_grace_s=300.0,
        topics=TopicsConfig(),
        kafka_security={},
        drain_timeout_s=0.0,
    )


def test_a_pipeline_with_every_field_set_reads_as_it_says() -> None:
    security = {
        "protocol": "SASL_SSL",
        "saslMechanism": "SCRAM-SHA-512",
        "username": "fluxjoin",
        "passwordSecret": {"name": "fluxjoin-user"},
        "caSecret": {"name": "cluster-ca", "key": "ca.pem"},
    }
    resources = {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": 4294967296}}
    spec = _read(
        streams=["on", "B"],
        windowMs=5000,
        allowedLatenessMs=0,
        partitions=16,
        replicas=4,
        handoffMode="parallel_track",
        policy={"name": "memory", "flux": {"thImb": 1.5}, "memory": {"thetaD": 0.5}},
        liveness={"heartbeatTimeoutSeconds": 30, "restartGraceSeconds": 0, "plannedRestart": "drain"},
        kafka={
            "bootstrapServers": "a:9092,b:9093",
            "topicPrefix": "shared.demo",
            "topics": {"create": False, "replicationFactor": 3, "minInsyncReplicas": 2, "retentionMs": -1},
            "security": security,
        },
        instance={
            "triggerMs": 0,
            "maxRowsPerBatch": 5000,
            "sparkMaster": "local[4]",
            "driverMemory": "1536m",
        },
        image="registry/fluxjoin:2",
        resources=resources,
        checkpoint={"size": "9Gi", "storageClassName": "fast"},
    )
    assert (spec.streams, spec.window_ms, spec.allowed_lateness_ms, spec.partitions, spec.replicas) == (
        ("on", "B"),
        5000,
        0,
        16,
        4,
    )
    assert spec.handoff_mode is HandoffMode.PARALLEL_TRACK
    assert (spec.policy, spec.policy_settings) == ("memory", {"theta_d": 0.5})
    assert spec.policy_params().theta_d == 0.5 and spec.policy_params().mode is HandoffMode.PARALLEL_TRACK
    assert (spec.heartbeat_timeout_s, spec.restart_grace_s, spec.drain_timeout_s) == (30.0, 0.0, 120.0)
    assert (spec.bootstrap_servers, spec.topic_prefix) == ("a:9092,b:9093", "shared.demo")
    assert spec.topics == TopicsConfig(
        create=False, replication_factor=3, min_insync_replicas=2, retention_ms=-1
    )
    assert spec.kafka_security == security, "as set: the operator's renderer fills in the Secrets' keys"
    assert spec.instance == InstanceConfig(
        trigger_ms=0,
        max_rows_per_batch=5000,
        spark_master="local[4]",
        driver_memory="1536m",
        work_dir=WORK_DIR,
        drain_timeout_s=120,
    )
    assert (spec.image, spec.resources, spec.checkpoint_size, spec.storage_class) == (
        "registry/fluxjoin:2",
        resources,
        "9Gi",
        "fast",
    )


def test_policy_settings_are_the_named_policys_as_set() -> None:
    assert _read(
        policy={"name": "flux", "flux": {"maxMovesPerPair": 4, "donorCost": True}}
    ).policy_settings == {
        "max_moves_per_pair": 4.0,
        "donor_cost": 1.0,
    }
    assert _read(policy={"name": "static", "flux": {"thImb": 2.0}}).policy_settings == {}


def test_an_empty_storage_class_or_topic_prefix_means_the_default() -> None:
    spec = _read(checkpoint={"storageClassName": ""}, liveness={"drainTimeoutSeconds": 90})
    assert (spec.storage_class, spec.topic_prefix, spec.drain_timeout_s) == (None, "ns.demo", 0.0)
    assert _read(checkpoint={"size": 1073741824}).checkpoint_size == "1073741824"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"handoffMode": "teleport"},
            "spec.handoffMode 'teleport' is not supported by this operator: use one of "
            "['transfer', 'replay', 'parallel_track']",
        ),
        ({"windowMs": 0}, "spec.windowMs: Input should be greater than 0"),
        ({"streams": ["A", "b-c"]}, "spec.streams.1: stream name 'b-c' must be an identifier"),
        (
            {"policy": {"name": "chaos"}},
            "spec.policy.name: policy 'chaos' is not one of "
            "['static', 'flux', 'memory', 'flux-memory', 'hybrid']",
        ),
        (
            {"policy": {"flux": {"thUtil": 1.5}}},
            "spec.policy.flux.thUtil: Input should be less than or equal to 1",
        ),
        ({"checkpoint": {"size": "lots"}}, "spec.checkpoint.size: 'lots' is not a Kubernetes quantity"),
        (
            {"kafka": {"bootstrapServers": "no-port"}},
            "spec.kafka.bootstrapServers: String should match pattern",
        ),
    ],
)
def test_a_spec_the_schema_refuses_names_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        _read(**spec)
    assert message in str(refused.value)


def test_a_field_of_a_newer_crd_is_ignored_as_the_api_server_prunes_unknown_ones() -> None:
    assert _read(instance={"pollMs": 5}, newField={"x": 1}) == _read()


def test_a_spec_without_kafka_is_refused() -> None:
    with pytest.raises(ValueError, match=r"spec\.kafka: Field required"):
        PipelineSpec.from_object({"metadata": META, "spec": {}})
