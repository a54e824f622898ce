"""docs/reference/api.md is generated from manifests/crd/: it fails when a CRD changes without the
page being regenerated (python -m hack.api_doc), like the CRDs' own drift test."""

from __future__ import annotations

from hack import api_doc
from hack.crds import load_crds


def test_the_api_reference_is_up_to_date() -> None:
    assert api_doc.PAGE.read_text() == api_doc.render(), "run python -m hack.api_doc"


def test_every_kind_and_every_spec_field_is_documented() -> None:
    text = api_doc.render()
    for crd in load_crds():
        kind = crd["spec"]["names"]["kind"]
        assert f"## {kind}\n" in text
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for field in schema["properties"]["spec"].get("properties", {}):
            assert f"| `spec.{field}` |" in text, (kind, field)
