"""The command line with no broker where it points: one line naming the address, exit status 3, no
traceback (a real socket with nothing listening; no broker is needed to show it)."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from fluxjoin.cli import app


def _nothing_listens() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("command", [["status"], ["move", "--pids", "1", "--to", "instance-1"]])
def test_a_command_without_a_broker_says_so_in_one_line(command: list[str]) -> None:
    address = _nothing_listens()
    result = CliRunner().invoke(app, [*command, "--bootstrap", address])
    assert result.exit_code == 3, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach Kafka at {address}"), result.output


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        pytest.param(
            ["status", "--set", "window_ms=-1"], {},
            "error: invalid configuration: window_ms: Input should be greater than 0",
            id="invalid-config-value",
        ),
        pytest.param(
            ["status", "--config", "/nonexistent/fluxjoin.yaml"], {},
            "error: config file /nonexistent/fluxjoin.yaml does not exist",
            id="missing-config-file",
        ),
        pytest.param(
            ["status"], {"FLUXJOIN_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"},
            "error: SASL_SSL needs FLUXJOIN_KAFKA_SASL_MECHANISM: one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512",
            id="incomplete-kafka-security",
        ),
        pytest.param(
            ["status"], {"FLUXJOIN_SIGNING_KEY_FILE": "/nonexistent/instance-0.key"},
            "error: FLUXJOIN_SIGNING_KEY_FILE is set but FLUXJOIN_CONTROLLER_PUBLIC_KEY_FILE is not: "
            "set both, or neither",
            id="signing-key-without-the-controllers",
        ),
        pytest.param(
            ["status"], {"FLUXJOIN_CONTROLLER_PUBLIC_KEY_FILE": "/nonexistent/controller.pub"},
            "error: FLUXJOIN_CONTROLLER_PUBLIC_KEY_FILE=/nonexistent/controller.pub: no such file",
            id="missing-controller-key",
        ),
        pytest.param(
            ["controller", "--set", "policy.name=chaos"], {},
            "error: unknown policy 'chaos'; choose from static, flux, memory, flux-memory, hybrid",
            id="unknown-configured-policy",
        ),
        pytest.param(
            ["controller", "--set", "policy={name: flux-memory, params: {th_imb: 0.5}}"], {},
            "error: policy parameters: th_imb must be >= 1, got 0.5",
            id="configured-policy-parameter-refused",
        ),
        pytest.param(
            ["controller", "--set", "policy.params={th_imb: 0.5}", "--policy", "memory",
             "--policy-param", "theta_d=2"], {},
            "error: policy parameters: theta_d must be in (0, 1], got 2.0",
            id="the-configs-parameters-are-its-policys-only",
        ),
        pytest.param(
            ["budget", "instance-0", "lots"], {},
            "error: 'lots' is not a size (256m, 1g, or bytes)",
            id="budget-not-a-size",
        ),
    ],
)  # fmt: skip
def test_a_usage_or_configuration_error_is_one_line_and_exit_status_2(
    args: list[str], env: dict[str, str], line: str
) -> None:
    result = CliRunner().invoke(app, [*args, "--bootstrap", _nothing_listens()], env=env)
    assert result.exit_code == 2, result.output
    assert [x for x in result.output.splitlines() if x.strip()] == [line]
