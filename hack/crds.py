"""Load the generated CRDs and samples, and install the CRDs into a cluster.

Shared by the e2e tests and ``make run`` so both install exactly what ``hack/codegen.py``
generated, and both wait for ``Established`` instead of sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

MANIFESTS_DIR = Path(__file__).resolve().parents[1] / "manifests"
CRD_DIR = MANIFESTS_DIR / "crd"
SAMPLES_DIR = MANIFESTS_DIR / "samples"


def _documents(directory: Path) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        with path.open(encoding="utf-8") as fh:
            docs.extend(d for d in yaml.safe_load_all(fh) if d)
    return docs


def load_crds(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    """Every CustomResourceDefinition in ``manifests/crd``, ordered by name."""
    crds = [d for d in _documents(directory) if d.get("kind") == "CustomResourceDefinition"]
    return sorted(crds, key=lambda d: str(d["metadata"]["name"]))


def load_samples(directory: Path = SAMPLES_DIR) -> list[dict[str, Any]]:
    """Every sample custom resource in ``manifests/samples``, in file order."""
    return _documents(directory)


def install_crds(
    api_client: Any,
    crds: Iterable[dict[str, Any]] | None = None,
    *,
    timeout: float = 60.0,
) -> list[str]:
    """Create or replace the CRDs and wait until each is Established; returns their names.

    ``api_client`` is a ``kubernetes.client.ApiClient``. Replacing (rather than skipping) an
    existing CRD keeps a long-lived dev cluster in step with regenerated YAML.
    """
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    api = client.ApiextensionsV1Api(api_client)
    names: list[str] = []
    for body in crds if crds is not None else load_crds():
        name = body["metadata"]["name"]
        try:
            api.create_custom_resource_definition(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = api.read_custom_resource_definition(name)
            replacement = {**body, "metadata": {**body["metadata"]}}
            replacement["metadata"]["resourceVersion"] = current.metadata.resource_version
            api.replace_custom_resource_definition(name, replacement)
        names.append(name)
    wait_established(api_client, names, timeout=timeout)
    return names


def wait_established(api_client: Any, names: Iterable[str], *, timeout: float = 60.0) -> None:
    """Poll until every named CRD has ``Established=True``; raise ``TimeoutError`` otherwise."""
    from kubernetes import client

    api = client.ApiextensionsV1Api(api_client)
    pending = set(names)
    deadline = time.monotonic() + timeout
    while pending:
        for name in sorted(pending):
            crd = api.read_custom_resource_definition(name)
            conditions = (crd.status.conditions if crd.status else None) or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                pending.discard(name)
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRDs not Established after {timeout:.0f}s: {sorted(pending)}")
        time.sleep(0.2)


def create_object(api_client: Any, obj: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    """Create one ``tailnet.dev`` object; namespaced kinds go to ``namespace`` unless set."""
    from kubernetes import client

    from tailnet_operator.api.registry import kind_of

    kind = kind_of(obj["kind"])
    api = client.CustomObjectsApi(api_client)
    if kind.namespaced:
        ns = obj.get("metadata", {}).get("namespace") or namespace
        if not ns:
            raise ValueError(f"{kind.kind} is namespaced: give a namespace")
        result: dict[str, Any] = api.create_namespaced_custom_object(
            kind.group, kind.version, ns, kind.plural, obj
        )
    else:
        result = api.create_cluster_custom_object(kind.group, kind.version, kind.plural, obj)
    return result
