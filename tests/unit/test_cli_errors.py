"""The command line with no broker where it points: one line naming the address, exit status 2, no
traceback (a real socket with nothing listening; no broker is needed to show it)."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from controller.cli import app


def _nothing_listens() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("command", [["status"], ["move", "--pids", "1", "--to", "instance-1"]])
def test_a_command_without_a_broker_says_so_in_one_line(command: list[str]) -> None:
    address = _nothing_listens()
    result = CliRunner().invoke(app, [*command, "--bootstrap", address])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot reach Kafka at {address}"), result.output
