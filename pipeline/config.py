"""The one configuration schema every `fluxjoin` subcommand shares.

A pipeline is described by a YAML file (optional) plus dotted command-line overrides
(`--set window_ms=5000`). Validation happens here, once, with messages that name the field,
so no other module re-checks values. Topic names are derived here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.spill import CleanupWhen, SpillChoice

MAX_STREAMS = 8
"""Streams one join may have: the `stream` column's codes (`pipeline.rows`) leave room for this many."""


class ConfigError(ValueError):
    """Raised for an invalid configuration file or override; the message is meant for the user."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- rate schedules (tuples per second per stream, as a function of seconds since start) ---


class ConstantRate(_Strict):
    kind: Literal["constant"] = "constant"
    rate: float = Field(1000.0, gt=0)


class StepRate(_Strict):
    """Piecewise constant: `steps` is a list of [start_second, rate], sorted by start second."""

    kind: Literal["steps"] = "steps"
    steps: list[tuple[float, float]] = Field(min_length=1)

    @model_validator(mode="after")
    def _sorted(self) -> StepRate:
        starts = [s for s, _ in self.steps]
        if starts != sorted(starts) or starts[0] != 0:
            raise ValueError("steps must start at second 0 and be sorted by start second")
        if any(r < 0 for _, r in self.steps):
            raise ValueError("step rates must be >= 0")
        return self


class ToggleRate(_Strict):
    """Alternates between `low` and `high` every `period_s` seconds, starting low (Tran & Lee)."""

    kind: Literal["toggle"] = "toggle"
    low: float = Field(50.0, ge=0)
    high: float = Field(200.0, ge=0)
    period_s: float = Field(2.0, gt=0)


class RampRate(_Strict):
    """Linear from `start` to `end` over `duration_s`, then holds `end`."""

    kind: Literal["ramp"] = "ramp"
    start: float = Field(100.0, ge=0)
    end: float = Field(1000.0, ge=0)
    duration_s: float = Field(60.0, gt=0)


RateSchedule = Annotated[ConstantRate | StepRate | ToggleRate | RampRate, Field(discriminator="kind")]


# --- key distributions ---


class UniformKeys(_Strict):
    kind: Literal["uniform"] = "uniform"
    count: int = Field(100_000, ge=1)


class ZipfKeys(_Strict):
    kind: Literal["zipf"] = "zipf"
    count: int = Field(100_000, ge=1)
    s: float = Field(1.1, gt=0)


class EightyTwentyKeys(_Strict):
    """80% of tuples draw from 20% of the keys (the papers' skew)."""

    kind: Literal["eighty_twenty"] = "eighty_twenty"
    count: int = Field(100_000, ge=5)


class HotSetKeys(_Strict):
    """`hot_share` of tuples draw from a hot set of `hot_fraction` of the keys; the set moves every
    `move_every_s` seconds to other keys (and so to other partitions)."""

    kind: Literal["hot_set"] = "hot_set"
    count: int = Field(100_000, ge=2)
    hot_fraction: float = Field(0.05, gt=0, lt=1)
    hot_share: float = Field(0.8, ge=0, le=1)
    move_every_s: float = Field(30.0, gt=0)


class HotPidsKeys(_Strict):
    """`hot_share` of tuples fall on a hot set of `hot_fraction` of the pids, keys uniform within a pid:
    the Flux paper's 80/20 skew over partitions, which key-level skew over many keys does not give (hot
    keys spread evenly over pids). The hot pids change every `move_every_s` seconds.

    `layout` says where the hot pids lie: `scattered` (a seeded order of the pids, so the hot set falls
    on every instance about evenly), or `contiguous` (the next run of neighbouring pids, from pid 0 on),
    which under the initial layout of contiguous pid ranges puts the hot set on one or two instances:
    skew that loads instances unevenly, as Flux's experiments with a loaded machine do.

    The first `even_s` seconds spread tuples evenly over the pids; the first hot set begins then. A
    benchmark uses it to warm the join up before the skew: an instance's first batches with input
    cost several times a later batch per tuple (compiling the join), and a policy deciding from them
    would be judged on a cold start, not on following a hot set (docs/load-model.md, "Rounds and move
    phases")."""

    kind: Literal["hot_pids"] = "hot_pids"
    count: int = Field(100_000, ge=1)
    hot_fraction: float = Field(0.2, gt=0, lt=1)
    hot_share: float = Field(0.8, ge=0, le=1)
    move_every_s: float = Field(30.0, gt=0)
    layout: Literal["scattered", "contiguous"] = "scattered"
    even_s: float = Field(0.0, ge=0)


KeyDistribution = Annotated[
    UniformKeys | ZipfKeys | EightyTwentyKeys | HotSetKeys | HotPidsKeys, Field(discriminator="kind")
]


class Silence(_Strict):
    """Stream `stream` has no tuples on `pids` with event-time offset (since the run's start) in
    [from_s, to_s): they are dropped at the source, as if they never arrived, while progress records keep
    saying how far those partitions have come (decision 0047). For tests and demos of an idle partition."""

    stream: str
    pids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    from_s: float = Field(ge=0)
    to_s: float

    @model_validator(mode="after")
    def _span(self) -> Silence:
        if self.to_s <= self.from_s:
            raise ValueError(f"silence of {self.stream}: to_s ({self.to_s}) must be > from_s ({self.from_s})")
        return self


class GeneratorConfig(_Strict):
    rate: RateSchedule = Field(default_factory=ConstantRate)
    # Per-stream overrides of `rate`, by stream name.
    stream_rates: dict[str, RateSchedule] = Field(default_factory=dict)
    keys: KeyDistribution = Field(default_factory=UniformKeys)
    payload_bytes: int = Field(16, ge=0, le=65536)
    seed: int = 42
    # Tuples of one stream and one pid packed into one Kafka message (at most).
    tuples_per_message: int = Field(256, ge=1, le=100_000)
    # real_time: event time = wall-clock arrival time, produced as it happens.
    # max_rate: event times follow the same Poisson process on a virtual clock, produced as fast as possible.
    mode: Literal["real_time", "max_rate"] = "real_time"
    duration_s: float | None = Field(60.0, gt=0)
    max_tuples: int | None = Field(None, ge=1)
    # A partition (stream, pid) the generator has written nothing to for this much event time gets a
    # progress record: without one, an idle partition holds its pid's windows of the other streams
    # (its next tuple may be as old as its last one minus the allowed lateness; decision 0047).
    progress_interval_ms: int = Field(1000, ge=1)
    # Spans in which a stream writes no tuples on some pids (progress records continue); see Silence.
    silences: list[Silence] = Field(default_factory=list)
    # real_time only: a stream's messages are produced this many ms after their event time, as from a
    # producer that runs behind the others. A max-rate run has no wall clock to lag behind.
    stream_lag_ms: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    # Tuples written late by the rule on purpose (below their partition's largest event time minus
    # allowed_lateness_ms), spread over the first 80% of the run; they need an expected end of the run.
    late_tuples: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _modes(self) -> GeneratorConfig:
        if self.mode == "max_rate" and any(self.stream_lag_ms.values()):
            raise ValueError(
                "generator.stream_lag_ms needs mode real_time: a max-rate run produces on a virtual clock, "
                "so there is no wall-clock time for a stream to lag behind"
            )
        if self.late_tuples and self.duration_s is None and self.max_tuples is None:
            raise ValueError(
                "generator.late_tuples needs generator.duration_s or generator.max_tuples "
                "(late tuples are spread over the run's expected length)"
            )
        return self

    def check_streams(self, streams: list[str], partitions: int) -> None:
        """Stream names and pids of silences and lags exist in the pipeline (Config's validator calls it)."""
        for i, silence in enumerate(self.silences):
            if silence.stream not in streams:
                raise ValueError(f"generator.silences[{i}].stream {silence.stream!r} is not one of {streams}")
            if max(silence.pids) >= partitions:
                raise ValueError(f"generator.silences[{i}].pids must be < partitions ({partitions})")
        unknown = set(self.stream_lag_ms) - set(streams)
        if unknown:
            raise ValueError(f"generator.stream_lag_ms names unknown streams: {sorted(unknown)}")


JVM_MEMORY = r"^[0-9]+[kKmMgGtT]?$"
"""A JVM memory setting as Spark takes it: 1g, 1536m, or plain bytes."""


class ExecutorsConfig(_Strict):
    """An instance's Spark executors as pods of Kubernetes (`pipeline.executors`): the instance's process
    is then the driver, and Spark's Kubernetes backend keeps `count` executor pods running, each with
    `cores` task slots and a heap of `memory`. Only inside a pod the operator made for it."""

    count: int = Field(1, ge=1, le=64)
    cores: int = Field(1, ge=1, le=64)
    memory: str = Field("1g", pattern=JVM_MEMORY)
    # The CPU each executor pod requests (a Kubernetes quantity such as 500m); None: `cores` whole CPUs.
    cpu_request: str | None = Field(None, pattern=r"^([0-9]+m|[0-9]+(\.[0-9]+)?)$")


class InstanceConfig(_Strict):
    trigger_ms: int = Field(500, ge=0)
    # How often an instance looks at its assignment when the trigger is longer (decision 0027): batches
    # still start a trigger apart, but one that releases or takes over a pid starts within poll_ms.
    poll_ms: int = Field(1000, ge=1)
    max_rows_per_batch: int = Field(200_000, ge=1000)
    # About how many results a batch may make: the sink collects a batch's results whole in the JVM's
    # heap, and a far-behind instance on hot keys ran out of a 2 GB heap on a batch of over 7.2 million
    # (decision 0045). Bounds the batch's input by the results per tuple of recent batches.
    max_results_per_batch: int = Field(4_000_000, ge=1000)
    # One shuffle partition per core of `spark_master`, and as many source read tasks: each stage runs
    # in one wave, and every task is a Python worker round trip, every partition a state store to load
    # and commit each batch (4 vs 2 on local[2], and 2 vs 1 on local[1]: measured slower; decision 0033).
    shuffle_partitions: int = Field(2, ge=1)
    # Where the query's tasks run without executors: inside the instance's own process, on this many
    # cores. Nothing else: a master of another kind needs what only `executors` sets up.
    spark_master: str = Field("local[2]", pattern=r"^local\[[1-9][0-9]*\]$")
    driver_memory: str = Field("1g", pattern=JVM_MEMORY)
    # Executor pods instead of local mode (`pipeline.executors`); None: local mode, `spark_master`.
    executors: ExecutorsConfig | None = None
    # How many bytes of window state (all its pids' windows) the instance may hold; 0: a quarter of the
    # driver's heap, where the state store keeps its windows (docs/memory.md says why a quarter). A
    # budget set while it runs (`fluxjoin budget`) replaces this one.
    state_budget_bytes: int = Field(0, ge=0)
    # Spilling (docs/memory.md): when the windows hold more than `spill_threshold` of the state budget,
    # about `spill_fraction` of their state leaves memory, whole pids in the order `spill_choice` gives,
    # and is cleaned up later (`spill_cleanup`); 0: never spill (an instance out of heap exits instead,
    # decision 0031).
    spill_threshold: float = Field(0.0, ge=0.0, le=1.0)
    spill_fraction: float = Field(0.3, gt=0.0, le=1.0)
    spill_choice: Literal["least-productive", "most-productive"] = SpillChoice.LEAST_PRODUCTIVE.value
    spill_cleanup: Literal["active", "lazy"] = CleanupWhen.ACTIVE.value
    work_dir: str = ".fluxjoin"
    # CPU cores each local instance process may use (a cgroup quota, like a pod's CPU limit); None: no limit.
    cpu_limit: float | None = Field(None, gt=0)
    # On SIGTERM, keep running up to this long while the controller moves this instance's pids to the
    # others, then stop (decision 0056); 0: stop at once and resume from the checkpoint on return. Only
    # the Kubernetes operator drains a stopping instance: it sets this from spec.liveness.
    drain_timeout_s: int = Field(0, ge=0)
    # Append where each batch's time went (Spark's phases and the sink's) to batch_timings.jsonl in the
    # instance's directory (`pipeline.batch_timings`): a diagnosis aid, a line per batch.
    batch_timings: bool = False

    def state_budget(self) -> int:
        """The configured state budget in bytes (`state_budget_bytes`, or its default from the heap)."""
        return self.state_budget_bytes or spark_bytes(self.driver_memory) // HEAP_SHARE_OF_STATE


HEAP_SHARE_OF_STATE = 4
"""The default state budget is the heap over this: the state store keeps, besides the newest version of a
pid's window, the versions of the last batches (`spark.sql.streaming.maxBatchesToRetainInMemory`, 2), and
a batch's results are collected in the same heap (docs/memory.md)."""


def spark_bytes(size: str) -> int:
    """Bytes of a JVM memory setting as Spark writes them: 1g, 1536m, 2048k, or plain bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    size = size.strip().lower()
    if size and size[-1] in units:
        return int(size[:-1]) * units[size[-1]]
    return int(size)


class TopicsConfig(_Strict):
    """How the pipeline's topics are made (`pipeline.topics`)."""

    # false: the topics must exist (made by whoever runs the cluster); fluxjoin only checks them.
    create: bool = True
    # -1: the broker's default.
    replication_factor: int = Field(-1, ge=-1, le=32767)
    # On every topic fluxjoin creates; None: the broker's default.
    min_insync_replicas: int | None = Field(None, ge=1)
    # Of the input, results and dead-letter topics; None: the broker's default (7 days). The control
    # topic always keeps everything, the commits topic is compacted.
    retention_ms: int | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _check(self) -> TopicsConfig:
        if self.replication_factor == 0:
            raise ValueError("topics.replication_factor must be -1 (the broker's default) or at least 1")
        return self


class PolicyConfig(_Strict):
    """The controller's policy (`fluxjoin controller`, whose --policy, --mode and --policy-param
    override it; on Kubernetes, `spec.policy` and `spec.handoffMode`). Names and parameters are checked
    against `controller.policies` when the controller starts."""

    # static, flux, memory, flux-memory or hybrid.
    name: str = "flux"
    # How the policy's moves hand a pid's window over.
    handoff_mode: Literal["transfer", "replay", "parallel_track"] = "transfer"
    # The policy's parameters by their names in its module (e.g. th_imb: 1.5; 0/1 or false/true for a
    # yes/no one); the others keep the defaults the papers give.
    params: dict[str, float] = Field(default_factory=dict)


class Config(_Strict):
    pipeline: str = Field("fluxjoin", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,100}$")
    bootstrap: str | None = None
    streams: list[str] = Field(default_factory=lambda: ["A", "B", "C"], min_length=2, max_length=MAX_STREAMS)
    window_ms: int = Field(10_000, gt=0)
    allowed_lateness_ms: int = Field(2_000, ge=0)
    partitions: int = Field(64, ge=1, le=4096)
    instances: int = Field(3, ge=1)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    instance: InstanceConfig = Field(default_factory=InstanceConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if len(set(self.streams)) != len(self.streams):
            raise ValueError("stream names must be unique")
        for name in self.streams:
            if not name.isidentifier():
                raise ValueError(f"stream name {name!r} must be an identifier (letters, digits, _)")
        unknown = set(self.generator.stream_rates) - set(self.streams)
        if unknown:
            raise ValueError(f"generator.stream_rates names unknown streams: {sorted(unknown)}")
        self.generator.check_streams(self.streams, self.partitions)
        if self.generator.keys.kind == "hot_pids" and self.generator.keys.count < 8 * self.partitions:
            raise ValueError(
                f"generator.keys.count must be >= 8 x partitions ({8 * self.partitions}) for hot_pids"
            )
        if self.partitions < self.instances:
            raise ValueError(f"partitions ({self.partitions}) must be >= instances ({self.instances})")
        return self

    # --- derived names: the only place topic names are spelled ---

    def input_topic(self, stream: str) -> str:
        return f"{self.pipeline}.in.{stream}"

    @property
    def input_topics(self) -> list[str]:
        return [self.input_topic(s) for s in self.streams]

    @property
    def results_topic(self) -> str:
        return f"{self.pipeline}.results"

    @property
    def dead_letter_topic(self) -> str:
        return f"{self.pipeline}.dead-letter"

    @property
    def sink_commits_topic(self) -> str:
        return f"{self.pipeline}.sink-commits"

    @property
    def metrics_topic(self) -> str:
        return f"{self.pipeline}.metrics"

    @property
    def handoff_topic(self) -> str:
        return f"{self.pipeline}.handoff"

    @property
    def control_topic(self) -> str:
        return f"{self.pipeline}.control"

    def rate_for(self, stream: str) -> ConstantRate | StepRate | ToggleRate | RampRate:
        return self.generator.stream_rates.get(stream, self.generator.rate)

    def with_overrides(self, **fields: Any) -> Config:
        """A copy with top-level or dotted fields replaced, validated again."""
        return _build(self.model_dump(), [f"{k}={yaml.safe_dump(v).strip()}" for k, v in fields.items()])


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _build(tree: dict[str, Any], overrides: Sequence[str]) -> Config:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
        _set_dotted(tree, key.strip(), value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            problems.append(f"{loc}: {err['msg']}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read the YAML file (if any), apply `key.path=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        tree = loaded or {}
    return _build(tree, overrides)
