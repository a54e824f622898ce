"""Generate the CustomResourceDefinitions in manifests/crd from the pydantic models.

Usage: ``python -m hack.codegen`` writes ``manifests/crd/<plural>.tailnet.dev.yaml`` and the
kustomization; ``python -m hack.codegen --check`` exits 1 naming the first file that differs
from what the models produce, so CI catches a model change without regenerated YAML.

Pydantic's JSON Schema is not what the apiserver accepts: a CRD needs a *structural* schema
(every node typed, no ``$ref``, no ``anyOf`` for Optional, no ``title``). ``structural()`` is
that conversion; it refuses keywords it does not know rather than passing them through.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from hack.crds import CRD_DIR
from tailnet_operator.api.registry import KINDS, Kind

# Keywords copied from pydantic's output as they are (after their values are converted).
_PASSTHROUGH = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
)
# Keywords that carry no meaning for the apiserver.
_DROPPED = ("title", "$defs", "uniqueItems")
# Fixed key order of one schema node, so the YAML is stable and reads top-down.
_ORDER = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "items",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "properties",
    "required",
    "additionalProperties",
    "x-kubernetes-validations",
)


class SchemaError(ValueError):
    """Pydantic produced something the converter cannot express as a structural schema."""


def _resolve(ref: str, defs: Mapping[str, Any]) -> dict[str, Any]:
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix) :] not in defs:
        raise SchemaError(f"unresolvable $ref {ref!r}")
    return dict(defs[ref[len(prefix) :]])


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` wins, except that CEL rule lists are concatenated (type rules first)."""
    out = dict(base)
    for key, value in over.items():
        if key == "x-kubernetes-validations" and key in out:
            out[key] = [*out[key], *value]
        else:
            out[key] = value
    return out


def _flatten(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """Inline ``$ref``/``allOf`` and collapse ``Optional`` (``anyOf: [X, null]``) into X."""
    node = dict(node)
    if "$ref" in node:
        target = _flatten(_resolve(node.pop("$ref"), defs), defs)
        node = _merge(target, node)
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise SchemaError(f"allOf with {len(parts)} members is not supported")
        node = _merge(_flatten(parts[0], defs), node)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"anyOf other than Optional is not structural: {node['anyOf']!r}")
        del node["anyOf"]
        if node.get("default", 0) is None:
            del node["default"]
        node = _merge(_flatten(branches[0], defs), node)
    if node.get("default", 0) is None:
        del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    return node


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], where: str) -> dict[str, Any]:
    node = _flatten(node, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key in _PASSTHROUGH:
            out[key] = copy.deepcopy(value)
        elif key == "properties":
            out["properties"] = {
                name: _convert(sub, defs, f"{where}.{name}") for name, sub in sorted(value.items())
            }
        elif key == "required":
            out["required"] = sorted(value)
        elif key == "items":
            out["items"] = _convert(value, defs, f"{where}[]")
        elif key == "additionalProperties":
            if value is False:
                continue  # extra="forbid": the apiserver prunes unknown fields anyway
            out["additionalProperties"] = _convert(value, defs, f"{where}{{}}")
        elif key == "anyOf":  # int-or-string only, see _flatten
            out["anyOf"] = [{"type": b["type"]} for b in value]
        elif key == "x-kubernetes-validations":
            out[key] = [_rule(r, where) for r in value]
        else:
            raise SchemaError(f"{where}: keyword {key!r} is not supported in a CRD schema")
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        raise SchemaError(f"{where}: schema node has no type")
    if "enum" in out and "type" not in out:
        raise SchemaError(f"{where}: enum without type")
    return {k: out[k] for k in sorted(out, key=_ORDER.index)}


def _rule(rule: Mapping[str, str], where: str) -> dict[str, str]:
    unknown = set(rule) - {"rule", "message", "fieldPath", "reason"}
    if unknown or "rule" not in rule or "message" not in rule:
        raise SchemaError(f"{where}: malformed CEL rule {dict(rule)!r}")
    return {k: rule[k] for k in ("rule", "message", "fieldPath", "reason") if k in rule}


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON Schema as a Kubernetes structural schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}), model.__name__)


def openapi_schema(kind: Kind) -> dict[str, Any]:
    """The root ``openAPIV3Schema`` of a kind: apiVersion, kind, metadata, spec, status."""
    model_doc = (kind.model.__doc__ or kind.kind).strip()
    return {
        "description": model_doc,
        "type": "object",
        "properties": {
            "apiVersion": {
                "description": "Versioned schema of this representation of an object.",
                "type": "string",
            },
            "kind": {"description": "REST resource this object represents.", "type": "string"},
            "metadata": {"type": "object"},
            "spec": structural(kind.spec),
            "status": structural(kind.status),
        },
        "required": ["spec"],
    }


def crd(kind: Kind) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": kind.crd_name,
            "labels": {"app.kubernetes.io/part-of": "tailnet-operator"},
        },
        "spec": {
            "group": kind.group,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": sorted(kind.short_names),
                "categories": sorted(kind.categories),
            },
            "scope": kind.scope,
            "versions": [
                {
                    "name": kind.version,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema(kind)},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [c.to_crd() for c in kind.columns],
                }
            ],
        },
    }


HEADER = "# Generated by `python -m hack.codegen` from tailnet_operator/api. DO NOT EDIT.\n"


def render(document: Mapping[str, Any], *, separator: bool = True) -> str:
    """Stable YAML: construction order, no aliases, wide lines so CEL rules stay on one line."""

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    body = yaml.dump(
        document,
        Dumper=_NoAliases,
        sort_keys=False,
        allow_unicode=True,
        width=1_000_000,
        default_flow_style=False,
    )
    return HEADER + ("---\n" if separator else "") + body


def kustomization(files: list[str]) -> dict[str, Any]:
    """The kustomization that installs every CRD."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": sorted(files),
    }


def generate() -> dict[str, str]:
    """File name (relative to manifests/crd) → content, for every generated file."""
    files = {f"{k.crd_name}.yaml": render(crd(k)) for k in KINDS}
    files["kustomization.yaml"] = render(kustomization(list(files)), separator=False)
    return dict(sorted(files.items()))


def check(directory: Path = CRD_DIR) -> list[str]:
    """Names of generated files that are missing or differ in ``directory``."""
    drifted = []
    for name, content in generate().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != content:
            drifted.append(name)
    return drifted


def write(directory: Path = CRD_DIR) -> list[Path]:
    """Write every generated file; returns the paths that changed."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, content in generate().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != content:
            path.write_text(content, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed CRDs are out of date")
    parser.add_argument("--dir", type=Path, default=CRD_DIR, help="output directory (default: manifests/crd)")
    args = parser.parse_args(argv)
    if args.check:
        drifted = check(args.dir)
        if drifted:
            print(
                f"{args.dir / drifted[0]} is out of date with tailnet_operator/api; "
                "run `python -m hack.codegen` and commit the result",
                file=sys.stderr,
            )
            return 1
        return 0
    for path in write(args.dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
