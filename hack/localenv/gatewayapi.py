"""The Gateway API's CRDs of the pinned version (standard channel), from its Go module: the
project installs none of them (a cluster's Gateway API is its platform's), so the tests and the
local environment apply them as a platform engineer would."""

from __future__ import annotations

from typing import Any

import yaml

from hack import binaries, versions

__all__ = ["MODULE", "crd_bodies", "crd_names", "standard_crd_bodies"]

MODULE = "sigs.k8s.io/gateway-api"
KINDS = ("gatewayclasses", "gateways", "httproutes", "grpcroutes", "tlsroutes", "tcproutes", "referencegrants")
"""The standard channel's CRDs the operator reads (and ReferenceGrant, which the specification pairs with them)."""


def crd_bodies() -> list[dict[str, Any]]:
    """The CRDs of :data:`KINDS` (``config/crd/standard`` of the module at :data:`versions.GATEWAY_API`)."""
    directory = binaries.module_dir(MODULE, versions.GATEWAY_API) / "config" / "crd" / "standard"
    bodies = []
    for kind in KINDS:
        path = directory / f"gateway.networking.k8s.io_{kind}.yaml"
        bodies += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return bodies


def crd_names() -> list[str]:
    return [f"{kind}.gateway.networking.k8s.io" for kind in KINDS]


def standard_crd_bodies() -> list[dict[str, Any]]:
    """Every CRD of the standard channel (what the conformance suite expects installed, each with
    the bundle-version annotation of :data:`versions.GATEWAY_API`)."""
    directory = binaries.module_dir(MODULE, versions.GATEWAY_API) / "config" / "crd" / "standard"
    bodies = []
    for path in sorted(directory.glob("gateway.networking.k8s.io_*.yaml")):
        bodies += [doc for doc in yaml.safe_load_all(path.read_text())
                   if doc and doc.get("kind") == "CustomResourceDefinition"]
    return bodies
