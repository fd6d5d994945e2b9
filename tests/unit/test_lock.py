"""The image installs its Python dependencies from requirements.lock with --require-hashes: every pin of
pyproject.toml's [project] dependencies must be the lock's, each locked package must carry its hashes,
and no plotting library may be in it (the runtime image has none)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _locked() -> dict[str, tuple[str, int]]:
    """Package -> (version, number of hashes), from requirements.lock."""
    text = (REPO / "requirements.lock").read_text()
    entry = r"^([A-Za-z0-9_.-]+)==(\S+) \\\n((?:\s+--hash=sha256:[0-9a-f]{64}(?: \\)?\n)+)"
    entries = re.findall(entry, text, re.M)
    return {name.lower(): (version, hashes.count("--hash=")) for name, version, hashes in entries}


def test_every_pin_of_pyproject_is_the_locks_and_every_locked_package_has_hashes() -> None:
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    locked = _locked()
    for pin in pins:
        name, version = pin.split("==")
        assert locked.get(name.lower(), ("missing", 0))[0] == version, f"{pin} is not requirements.lock's"
    lines = [line for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line]
    assert len(locked) == len(lines), "a locked package without hashes"
    assert all(count >= 1 for _, count in locked.values())


def test_the_image_has_no_plotting_library() -> None:
    assert "matplotlib" not in _locked()
