"""The plain manifests in k8s/ stay in step with the Helm chart (no API server needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.cluster import REPO

CHART = REPO / "charts" / "fluxjoin"
CHART_CRD = CHART / "crds" / "joinpipelines.fluxjoin.io.yaml"
PLAIN_CRD = REPO / "k8s" / "crd" / "joinpipelines.fluxjoin.io.yaml"


def _helm_template(bin_dir: Path, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(bin_dir / "helm"), "template", "fluxjoin", str(CHART), "--namespace", "fluxjoin", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _kustomize(bin_dir: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(bin_dir / "kubectl"), "kustomize", str(REPO / "k8s")], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_crd_copies_are_identical() -> None:
    assert PLAIN_CRD.read_bytes() == CHART_CRD.read_bytes(), (
        f"{PLAIN_CRD.relative_to(REPO)} differs from {CHART_CRD.relative_to(REPO)}: "
        "both are generated: run `python -m controller.k8s.crd`"
    )


def test_plain_role_grants_exactly_the_charts_rules(k8s_bin: Path) -> None:
    chart_role = _one(_helm_template(k8s_bin), "Role")
    plain_role = _one(_kustomize(k8s_bin), "Role")
    assert plain_role["rules"] == chart_role["rules"]
    assert plain_role["metadata"]["name"] == chart_role["metadata"]["name"] == "fluxjoin-operator"


def test_plain_deployment_matches_the_charts_contract(k8s_bin: Path) -> None:
    """Same service account, args, env and ports as the chart renders for a release named fluxjoin."""
    chart = _one(_helm_template(k8s_bin), "Deployment")["spec"]["template"]["spec"]
    plain = _one(_kustomize(k8s_bin), "Deployment")["spec"]["template"]["spec"]
    assert plain["serviceAccountName"] == chart["serviceAccountName"]
    assert plain["securityContext"] == chart["securityContext"]
    (chart_c,) = chart["containers"]
    (plain_c,) = plain["containers"]
    for key in ("args", "env", "ports", "image", "securityContext", "livenessProbe", "readinessProbe"):
        assert plain_c.get(key) == chart_c.get(key), key


def test_plain_crd_is_the_one_in_the_kustomization(k8s_bin: Path) -> None:
    crd = _one(_kustomize(k8s_bin), "CustomResourceDefinition")
    assert crd == yaml.safe_load(CHART_CRD.read_text())


def test_helm_lint_is_clean(k8s_bin: Path) -> None:
    """`helm lint --strict` (warnings fail too) with the defaults and with every optional part switched on."""
    chart = REPO / "charts" / "fluxjoin"
    every_part = "pipeline.create=true,kafka.trial.enabled=true,generator.enabled=true,executors.enabled=true"
    for extra in ([], ["--set", every_part, "--set", "pipeline.instance.executors.count=2"]):
        out = subprocess.run(
            [str(k8s_bin / "helm"), "lint", "--strict", str(chart), *extra], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
