"""The `fluxjoin` command: thin wiring from flags to the modules that do the work.

Every subcommand takes the same `--config FILE`, repeated `--set key.path=value` overrides and
`--bootstrap HOST:PORT`; without `--bootstrap` they use the embedded broker that `fluxjoin kafka start`
(or `fluxjoin demo`) runs. Heavy imports (Spark, matplotlib) happen inside the commands that need them.
This module gathers the commands of `run`, `operations` and `benchmarks` into one app, in the order of
its help.
"""

from __future__ import annotations

import sys

import typer

from fluxjoin import operations, run
from fluxjoin.benchmarks import bench_app
from fluxjoin.operations import kafka_app
from fluxjoin.options import fail

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="fluxjoin: an adaptive, partitioned windowed stream join on Kafka and Spark.",
)


@app.callback()
def _kafka_security() -> None:
    """Check the FLUXJOIN_KAFKA_* and signing settings (docs/security.md) before any command makes a
    Kafka client."""
    from pipeline.kafka_client import KafkaSecurity, KafkaSecurityError
    from pipeline.signing import SigningError, check_settings

    try:
        KafkaSecurity.from_env()
        check_settings()
    except (KafkaSecurityError, SigningError) as exc:
        fail(str(exc))


app.command()(run.generate)
app.command()(run.instance)
app.command()(run.executor)
app.command()(operations.verify)
app.command()(run.demo)
app.command()(run.controller)
app.command()(operations.move)
app.command()(operations.budget)
app.command()(operations.topics)
app.command()(operations.acls)
app.command()(operations.keys)
app.command()(operations.status)
app.command("operator")(run.operator_command)
app.add_typer(kafka_app, name="kafka")
app.add_typer(bench_app, name="bench")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
