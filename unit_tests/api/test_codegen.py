"""The generated CRDs: in step with the models, structural, and shaped as the conventions ask."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack import codegen
from hack.crds import CRD_DIR, SAMPLES_DIR, load_crds
from tailnet_operator.api.registry import KINDS, Kind, kind_of

CRDS = {c["spec"]["names"]["kind"]: c for c in load_crds()}


def _schema(kind: Kind) -> dict[str, Any]:
    schema: dict[str, Any] = CRDS[kind.kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


# -- drift ----------------------------------------------------------------------------------------


def test_committed_crds_match_the_models() -> None:
    """Fails when a model changed and `python -m hack.codegen` was not run."""
    assert codegen.check(CRD_DIR) == [], "run `python -m hack.codegen` and commit manifests/crd"


def test_check_names_the_drifted_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(CRD_DIR, tmp_path, dirs_exist_ok=True)
    assert codegen.main(["--check", "--dir", str(tmp_path)]) == 0
    target = tmp_path / "tailnetsites.tailnet.dev.yaml"
    target.write_text(target.read_text().replace("routerTag", "routerTags"))
    assert codegen.main(["--check", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "tailnetsites.tailnet.dev.yaml" in err


def test_check_detects_a_model_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed model (here: a description) makes the committed YAML stale."""
    codegen.write(tmp_path)
    from tailnet_operator.api.site import TailnetSiteSpec

    field = TailnetSiteSpec.model_fields["router_tag"]
    monkeypatch.setattr(field, "description", "changed")
    TailnetSiteSpec.model_rebuild(force=True)
    try:
        assert codegen.check(tmp_path) == ["tailnetsites.tailnet.dev.yaml"]
    finally:
        monkeypatch.undo()
        TailnetSiteSpec.model_rebuild(force=True)
    assert codegen.check(tmp_path) == []


def test_generation_is_deterministic() -> None:
    assert codegen.generate() == codegen.generate()


def test_write_creates_missing_files(tmp_path: Path) -> None:
    written = codegen.write(tmp_path / "crd")
    assert sorted(p.name for p in written) == sorted(codegen.generate())
    assert codegen.write(tmp_path / "crd") == []


# -- shape ----------------------------------------------------------------------------------------


def test_one_crd_per_kind_with_registry_names() -> None:
    assert sorted(CRDS) == sorted(k.kind for k in KINDS)
    for kind in KINDS:
        crd = CRDS[kind.kind]
        assert crd["metadata"]["name"] == f"{kind.plural}.tailnet.dev"
        names = crd["spec"]["names"]
        assert names["plural"] == kind.plural and names["singular"] == kind.singular
        assert names["categories"] == ["tailnet-all"]
        assert names["shortNames"]
        assert crd["spec"]["scope"] == kind.scope
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}


def test_no_category_is_also_a_kinds_name() -> None:
    """kubectl expands a category before it looks a name up: a category named like a kind makes
    ``kubectl get tailnet NAME`` ask every kind of the category for NAME, and fail."""
    names = {n for crd in CRDS.values() for n in (crd["spec"]["names"]["singular"], crd["spec"]["names"]["plural"],
                                                  *crd["spec"]["names"]["shortNames"])}
    categories = {c for crd in CRDS.values() for c in crd["spec"]["names"]["categories"]}
    assert not categories & names


def test_scopes() -> None:
    scopes = {k.kind: CRDS[k.kind]["spec"]["scope"] for k in KINDS}
    assert scopes == {
        "Tailnet": "Cluster",
        "TailnetEgress": "Namespaced",
        "TailnetIngress": "Namespaced",
        "TailnetSite": "Cluster",
        "TailnetGateway": "Cluster",
    }


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_printer_columns(kind: Kind) -> None:
    columns = CRDS[kind.kind]["spec"]["versions"][0]["additionalPrinterColumns"]
    names = [c["name"] for c in columns]
    assert names[:2] == ["Ready", "Reason"]
    assert names[-2:] == ["Age", "Message"]
    assert len(names) >= 5, "at least one domain column"
    assert columns[0]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns[-1]["priority"] == 1
    assert all("priority" not in c for c in columns[:-1])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_schema_is_structural(kind: Kind) -> None:
    forbidden = {"$ref", "$defs", "title", "oneOf", "allOf", "not", "const", "definitions"}
    for path, node in _nodes(_schema(kind)):
        assert not forbidden & set(node), f"{path}: {forbidden & set(node)}"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, f"{path}: anyOf without int-or-string"
            assert all(set(b) == {"type"} for b in node["anyOf"]), path
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        if node.get("type") == "array":
            assert "items" in node, path
        if "properties" in node:
            assert node["type"] == "object", path
            assert set(node.get("required", [])) <= set(node["properties"]), path
            assert node.get("required", []) == sorted(node.get("required", [])), path
        assert node.get("additionalProperties") is not False, path
        assert node.get("default", 0) is not None, f"{path}: null default"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_every_field_is_described(kind: Kind) -> None:
    schema = _schema(kind)
    for part in ("spec", "status"):
        for path, node in _nodes(schema["properties"][part], part):
            if path.endswith(("[]", "{}")) and node.get("type") not in ("object", "array"):
                continue  # kubectl explain shows the list's (map's) description for scalar items
            assert node.get("description"), f"{path} has no description for kubectl explain"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_status_has_conditions_as_a_map(kind: Kind) -> None:
    status = _schema(kind)["properties"]["status"]["properties"]
    assert status["observedGeneration"]["type"] == "integer"
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    item = conditions["items"]
    assert item["required"] == ["lastTransitionTime", "message", "reason", "status", "type"]
    assert item["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert item["properties"]["lastTransitionTime"]["format"] == "date-time"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_list_map_keys_are_required_or_defaulted(kind: Kind) -> None:
    for path, node in _nodes(_schema(kind)):
        for key in node.get("x-kubernetes-list-map-keys", []):
            item = node["items"]
            assert key in item.get("required", []) or "default" in item["properties"][key], f"{path}: {key}"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_cel_rules_are_well_formed(kind: Kind) -> None:
    for path, node in _nodes(_schema(kind)):
        for rule in node.get("x-kubernetes-validations", []):
            assert set(rule) <= {"rule", "message", "fieldPath", "reason"}, path
            assert rule["rule"] and rule["message"], path
            if "fieldPath" in rule:
                child = rule["fieldPath"].lstrip(".")
                assert child in node.get("properties", {}), f"{path}: fieldPath {rule['fieldPath']}"
            if "oldSelf" not in rule["rule"]:
                continue
            assert "self == oldSelf" in rule["rule"] or "has(oldSelf" in rule["rule"], path


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_patterns_compile_and_strings_are_bounded(kind: Kind) -> None:
    schema = _schema(kind)
    for path, node in [*_nodes(schema["properties"]["spec"]), *_nodes(schema["properties"]["status"])]:
        if "pattern" in node:
            re.compile(node["pattern"])
        if node.get("type") == "string" and "enum" not in node and "format" not in node:
            assert "maxLength" in node, f"{path}: unbounded string (CEL cost, etcd size)"
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list"


def test_tag_and_cidr_validation_is_in_the_schema() -> None:
    egress = _schema(kind_of("TailnetEgress"))
    assert egress["properties"]["spec"]["properties"]["tag"]["pattern"] == "^tag:[a-z][a-z0-9-]*$"
    site = _schema(kind_of("TailnetSite"))
    route = site["properties"]["spec"]["properties"]["routes"]["items"]
    rules = [r["rule"] for r in route["x-kubernetes-validations"]]
    assert "isCIDR(self)" in rules


def test_receipts_are_write_once() -> None:
    gateway = _schema(kind_of("TailnetGateway"))
    receipts = gateway["properties"]["status"]["properties"]["receipts"]
    assert {"rule": "self == oldSelf", "message": "receipts are written once"} in receipts[
        "x-kubernetes-validations"
    ]


def test_defaults_are_documented() -> None:
    """Every default in the schema is also stated in the field's description."""
    for kind in KINDS:
        for path, node in _nodes(_schema(kind)):
            if "default" in node:
                assert f"Defaults to {node['default']}".lower() in node["description"].lower(), path


# -- files ----------------------------------------------------------------------------------------


def test_kustomizations_list_every_file() -> None:
    crd_k = yaml.safe_load((CRD_DIR / "kustomization.yaml").read_text())
    assert sorted(crd_k["resources"]) == sorted(p.name for p in CRD_DIR.glob("*.tailnet.dev.yaml"))
    sample_k = yaml.safe_load((SAMPLES_DIR / "kustomization.yaml").read_text())
    samples = sorted(p.name for p in SAMPLES_DIR.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(sample_k["resources"]) == samples


def test_yaml_carries_the_generated_header() -> None:
    for path in CRD_DIR.glob("*.yaml"):
        assert path.read_text().startswith(codegen.HEADER), path


def test_converter_refuses_unknown_keywords() -> None:
    from pydantic import BaseModel, Field

    class Odd(BaseModel):
        value: int | str = Field(description="not a quantity")

    with pytest.raises(codegen.SchemaError):
        codegen.structural(Odd)
