"""The one fluxjoin image builds on the local Docker engine and its entry point works."""

from __future__ import annotations

import subprocess

from tests.k8s.cluster import REPO

TAG = "fluxjoin:test"


def test_image_builds_and_runs_the_cli_as_a_non_root_user() -> None:
    build = subprocess.run([str(REPO / "scripts" / "build-image.sh"), TAG], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    run = subprocess.run(
        ["docker", "run", "--rm", TAG, "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    for command in ("demo", "instance", "controller", "operator", "generate", "verify"):
        assert command in run.stdout
    user = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "id", TAG, "-u"], capture_output=True, text=True, timeout=60
    )
    assert user.stdout.strip() == "10001"
    # One lookup per tool (dash's `command -v a b` looks up the first only), and pip as a module.
    probe = "for t in gcc cc make pip pip3; do command -v $t; done; python -m pip --version; java -version"
    tools = subprocess.run(
        ["docker", "run", "--rm", "--entrypoint", "sh", TAG, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tools.stdout.strip() == "", f"build tools in the final image: {tools.stdout}"
    assert "No module named pip" in tools.stderr, tools.stderr
    assert "openjdk" in tools.stderr.lower()
