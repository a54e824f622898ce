"""The Helm chart with the pinned Helm (hack/versions.py): lint, renders for the default and
the documented values (manifests/chart/tailnet-operator/tests/ci-*.yaml), values refused by the
schema or a guard with their message, and manifests/install/ equal to the chart's output.

No cluster: `helm lint` and `helm template` only. e2e/test_helm_install.py installs the chart
into the local node."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack import binaries, render_install
from hack.crds import CRD_DIR

pytestmark = pytest.mark.integration

CHART = render_install.CHART
VALUES = CHART / "tests"


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binaries.binary("helm")), *args], capture_output=True, text=True, check=False,
                          timeout=120)


def _objects(stdout: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(stdout) if d]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def test_helm_lint_passes_strict_for_the_defaults_and_every_documented_values_file() -> None:
    for values in [None, *sorted(VALUES.glob("ci-*.yaml"))]:
        result = _helm("lint", "--strict", str(CHART), *(["--values", str(values)] if values else []))
        assert result.returncode == 0, f"{values}:\n{result.stdout}\n{result.stderr}"


def test_the_defaults_render_an_ha_operator_with_kept_crds() -> None:
    result = render_install.helm_template()
    assert result.returncode == 0, result.stderr
    objects = _objects(result.stdout)
    deployment = _one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert "--leader-elect" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
    crds = [o for o in objects if o["kind"] == "CustomResourceDefinition"]
    assert {c["metadata"]["name"] for c in crds} == {
        p.name.removesuffix(".yaml") for p in CRD_DIR.glob("*.tailnet.dev.yaml")}
    for crd in crds:
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["labels"]["app.kubernetes.io/component"] == "crd"
    namespaces = [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"]
    assert namespaces == ["tailnet-gateway"], "Helm installs into an existing namespace; it makes only the gateway's"
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels["helm.sh/chart"] == "tailnet-operator-0.1.0", obj["metadata"]["name"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


@pytest.mark.parametrize("values", sorted(VALUES.glob("ci-*.yaml")), ids=lambda p: p.stem)
def test_each_documented_values_file_renders(values: Path) -> None:
    result = render_install.helm_template("--values", str(values))
    assert result.returncode == 0, result.stderr
    given = yaml.safe_load(values.read_text())
    objects = _objects(result.stdout)
    deployment = _one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == given.get("replicaCount", 2)
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert bool(pdbs) == given.get("podDisruptionBudget", {}).get("enabled", True)
    if "image" in given:
        image = given["image"]
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == \
            f"{image['repository']}:{image['tag']}"
    if "fullnameOverride" in given:
        assert deployment["metadata"]["name"] == given["fullnameOverride"]


@pytest.mark.parametrize("values", sorted(VALUES.glob("bad-*.yaml")), ids=lambda p: p.stem)
def test_values_that_cannot_work_fail_with_their_message(values: Path) -> None:
    first = values.read_text().splitlines()[0]
    assert first.startswith("# expect: ")
    result = render_install.helm_template("--values", str(values))
    assert result.returncode != 0, f"{values.name} rendered"
    assert first.removeprefix("# expect: ") in result.stderr, result.stderr
    if values.name.startswith("bad-schema-"):
        assert "values don't meet the specifications of the schema" in result.stderr, result.stderr
    else:
        assert "execution error" in result.stderr, result.stderr


def test_manifests_install_is_the_charts_output() -> None:
    """The drift test: run `python -m hack.render_install` after changing the chart or the CRDs."""
    files = render_install.expected()
    differ = [str(p.relative_to(render_install.REPO)) for p, content in files.items()
              if not p.is_file() or p.read_text() != content]
    assert not differ, f"out of date, run python -m hack.render_install: {differ}"
    stale = render_install.stale(files)
    assert not stale, f"no longer generated, run python -m hack.render_install: {stale}"
