"""What the `fluxjoin` commands share: option types, exit statuses and one-line errors, and the
configuration and Kafka cluster that `--config`, `--set` and `--bootstrap` name.

Apart from `cli` so that the modules of commands and the app that gathers them all import it, and not
each other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from controller.assignment import HandoffMode
from pipeline.config import Config, ConfigError, load_config

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="YAML configuration file.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config field: key.path=value (repeatable).")
]
BootstrapOpt = Annotated[
    str | None, typer.Option("--bootstrap", help="Use this Kafka cluster instead of the embedded broker.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
ModeOpt = Annotated[str, typer.Option("--mode", help="Handoff mode: transfer, replay or parallel-track.")]


EXIT_NOT_EXACT, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3
"""Exit statuses (README): 0 done (`verify`: exact); 1 `verify` found the results not exact, or `move`
did not complete in time; 2 a usage or configuration error; 3 Kafka unreachable or refusing us."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix: printed as one line, no traceback."""
    from local.cpu_budget import CpuBudgetError
    from pipeline.topics import BrokerUnreachable, TopicError

    return (ConfigError, BrokerUnreachable, TopicError, CpuBudgetError)


def read_config(config: Path | None, sets: list[str] | None, bootstrap: str | None) -> Config:
    try:
        cfg = load_config(config, sets or [])
        if bootstrap:
            cfg = cfg.with_overrides(bootstrap=bootstrap)
        return cfg
    except ConfigError as exc:
        fail(str(exc))


def broker_address(cfg: Config) -> str:
    """The cluster to talk to: `--bootstrap`, else the running embedded broker."""
    if cfg.bootstrap:
        return cfg.bootstrap
    from local import kafka_runtime

    address = kafka_runtime.running_address()
    if address is None:
        fail(
            "no Kafka broker: run `fluxjoin kafka start` first, or pass --bootstrap HOST:PORT",
            EXIT_UNREACHABLE,
        )
    return address


def handoff_mode(value: str) -> HandoffMode:
    try:
        return HandoffMode(value.replace("-", "_"))
    except ValueError:
        fail(f"unknown handoff mode {value!r}; choose from {', '.join(m.value for m in HandoffMode)}")


def progress(json_: bool) -> Callable[[str], None]:
    """Where a command's progress lines go: stderr when stdout carries the JSON summary."""
    return (lambda m: print(m, file=sys.stderr, flush=True)) if json_ else print
