"""The generated CRDs against a real kube-apiserver.

The apiserver compiles every CEL rule and checks its cost when a CRD is created, so installing
them here is the test that the rules are valid at all; the invalid examples then prove that
each rule and pattern fires and that its error names the offending field.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from hack.crd_examples import INVALID_EXAMPLES, InvalidExample
from hack.crds import create_object, install_crds, load_crds, load_samples
from tailnet_operator.api.registry import KINDS, kind_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def api(control_plane: Any) -> Iterator[client.ApiClient]:
    """An admin client with every CRD installed and Established."""
    api_client = control_plane.api_client()
    install_crds(api_client, timeout=60)
    try:
        yield api_client
    finally:
        api_client.close()


@pytest.fixture(scope="module")
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"crds-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        core.delete_namespace(name)


def _read(api: client.ApiClient, kind: str, name: str, namespace: str) -> dict[str, Any]:
    k = kind_of(kind)
    objects = client.CustomObjectsApi(api)
    if k.namespaced:
        result: dict[str, Any] = objects.get_namespaced_custom_object(
            k.group, k.version, namespace, k.plural, name
        )
    else:
        result = objects.get_cluster_custom_object(k.group, k.version, k.plural, name)
    return result


def _delete(api: client.ApiClient, kind: str, name: str, namespace: str) -> None:
    k = kind_of(kind)
    objects = client.CustomObjectsApi(api)
    try:
        if k.namespaced:
            objects.delete_namespaced_custom_object(k.group, k.version, namespace, k.plural, name)
        else:
            objects.delete_cluster_custom_object(k.group, k.version, k.plural, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def test_every_crd_is_established(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    names = {c["metadata"]["name"] for c in load_crds()}
    assert names == {k.crd_name for k in KINDS}
    for name in names:
        crd = ext.read_custom_resource_definition(name)
        established = [c for c in crd.status.conditions if c.type == "Established"]
        assert established and established[0].status == "True", name


def test_install_is_idempotent(api: client.ApiClient) -> None:
    """``make run`` installs into a live cluster again and again."""
    assert sorted(install_crds(api, timeout=30)) == sorted(k.crd_name for k in KINDS)


@pytest.mark.parametrize("sample", load_samples(), ids=lambda s: s["kind"])
def test_sample_is_accepted(api: client.ApiClient, namespace: str, sample: dict[str, Any]) -> None:
    obj = copy.deepcopy(sample)
    obj["metadata"]["name"] = f"sample-{obj['metadata']['name']}"
    try:
        created = create_object(api, obj, namespace)
        model = kind_of(obj["kind"]).model
        # Nothing was pruned and the apiserver defaulted exactly what the models default.
        assert created["spec"] == model.model_validate(obj).spec.to_wire()  # type: ignore[attr-defined]
        # And the stored object parses with the models the operator reads it with.
        model.model_validate(created)
    finally:
        _delete(api, obj["kind"], obj["metadata"]["name"], namespace)


@pytest.mark.parametrize("example", INVALID_EXAMPLES, ids=lambda e: e.id)
def test_invalid_object_is_rejected(api: client.ApiClient, namespace: str, example: InvalidExample) -> None:
    obj = example.build()
    with pytest.raises(ApiException) as info:
        create_object(api, obj, namespace)
        _delete(api, obj["kind"], obj["metadata"]["name"], namespace)
    assert info.value.status == 422, info.value.body
    assert example.field in str(info.value.body), info.value.body


def test_tls_passthrough_exposes_are_accepted(api: client.ApiClient, namespace: str) -> None:
    """tls exposes sharing a port, with an exact, a wildcard and a * host, a name also served on
    another port, and the apiserver's defaults (unmatchedPaths) leave them valid."""
    sample = next(copy.deepcopy(s) for s in load_samples() if s["kind"] == "TailnetIngress")
    sample["metadata"]["name"] = "tls-passthrough"
    sample["spec"]["exposes"] += [
        {"name": "pg", "mode": "tls", "port": 5432, "backend": {"service": "postgres", "port": 5432},
         "hosts": [{"name": "pg.apps.example.internal", "alias": "pg"}, {"name": "*.pg.apps.example.internal"}]},
        {"name": "any", "mode": "tls", "port": 5432, "backend": {"service": "postgres", "port": 5433},
         "hosts": [{"name": "*"}]},
        {"name": "pg-again", "mode": "tls", "port": 6432, "backend": {"service": "postgres", "port": 5432},
         "hosts": [{"name": "pg.apps.example.internal"}]}]
    try:
        created = create_object(api, sample, namespace)
        model = kind_of("TailnetIngress").model
        assert created["spec"] == model.model_validate(sample).spec.to_wire()  # type: ignore[attr-defined]
        assert created["spec"]["exposes"][2]["hosts"][0]["unmatchedPaths"] == "Backend"
        model.model_validate(created)
    finally:
        _delete(api, "TailnetIngress", "tls-passthrough", namespace)


def test_defaults_are_applied(api: client.ApiClient, namespace: str) -> None:
    """Defaults documented in the schema are what the operator reads back."""
    tailnet = {
        "apiVersion": "tailnet.dev/v1alpha1",
        "kind": "Tailnet",
        "metadata": {"name": "defaults"},
        "spec": {
            "loginURL": "https://headscale.example.internal",
            "bootstrapKeySecretRef": {"namespace": "tailnet-system", "name": "bootstrap"},
            "policy": {"baseConfigMapRef": {"namespace": "tailnet-system", "name": "base"}},
        },
    }
    gateway = {
        "apiVersion": "tailnet.dev/v1alpha1",
        "kind": "TailnetGateway",
        "metadata": {"name": "defaults"},
        "spec": {"tailnetRef": {"name": "headscale"}, "tag": "tag:gw", "image": "tailscale/tailscale:v1"},
    }
    try:
        t = create_object(api, tailnet)["spec"]
        assert t["apiKeyLifetime"] == "720h"
        assert t["bootstrapKeySecretRef"]["key"] == "apiKey"
        assert t["policy"] == {
            "baseConfigMapRef": {"namespace": "tailnet-system", "name": "base", "key": "policy.hujson"},
            "mode": "Render",
        }
        g = create_object(api, gateway)["spec"]
        assert g["suspend"] is True
        assert g["deletionPolicy"] == "Retain"
    finally:
        _delete(api, "Tailnet", "defaults", namespace)
        _delete(api, "TailnetGateway", "defaults", namespace)


def _gateway(api: client.ApiClient, name: str) -> dict[str, Any]:
    sample = next(s for s in load_samples() if s["kind"] == "TailnetGateway")
    obj = copy.deepcopy(sample)
    obj["metadata"]["name"] = name
    return create_object(api, obj)


def test_gateway_receipts_are_written_once(api: client.ApiClient, namespace: str) -> None:
    objects = client.CustomObjectsApi(api)
    k = kind_of("TailnetGateway")
    gw = _gateway(api, "receipts")
    try:
        receipts = {"nodeId": "7", "nodeKey": "nodekey:abc", "createdAt": "2026-01-02T03:04:05Z"}
        gw["status"] = {"observedGeneration": 1, "receipts": receipts}
        gw = objects.replace_cluster_custom_object_status(k.group, k.version, k.plural, "receipts", gw)
        assert gw["status"]["receipts"] == receipts

        # Conditions may change freely alongside unchanged receipts.
        gw["status"]["conditions"] = [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Created",
                "message": "router created",
                "lastTransitionTime": "2026-01-02T03:04:06Z",
            }
        ]
        gw = objects.replace_cluster_custom_object_status(k.group, k.version, k.plural, "receipts", gw)

        rewritten = copy.deepcopy(gw)
        rewritten["status"]["receipts"]["nodeId"] = "8"
        with pytest.raises(ApiException) as info:
            objects.replace_cluster_custom_object_status(k.group, k.version, k.plural, "receipts", rewritten)
        assert info.value.status == 422
        assert "status.receipts" in info.value.body and "receipts are written once" in info.value.body

        removed = copy.deepcopy(gw)
        del removed["status"]["receipts"]
        with pytest.raises(ApiException) as info:
            objects.replace_cluster_custom_object_status(k.group, k.version, k.plural, "receipts", removed)
        assert info.value.status == 422
        assert "receipts cannot be removed" in info.value.body
    finally:
        _delete(api, "TailnetGateway", "receipts", namespace)


def test_gateway_identity_is_immutable(api: client.ApiClient, namespace: str) -> None:
    objects = client.CustomObjectsApi(api)
    k = kind_of("TailnetGateway")
    gw = _gateway(api, "immutable")
    try:
        # Image and suspend follow the spec...
        gw["spec"]["suspend"] = False
        gw["spec"]["image"] = "docker.io/tailscale/tailscale:v1.98.11"
        gw = objects.replace_cluster_custom_object(k.group, k.version, k.plural, "immutable", gw)
        # ...the tag does not.
        gw["spec"]["tag"] = "tag:other"
        with pytest.raises(ApiException) as info:
            objects.replace_cluster_custom_object(k.group, k.version, k.plural, "immutable", gw)
        assert info.value.status == 422
        assert "spec.tag" in info.value.body
    finally:
        _delete(api, "TailnetGateway", "immutable", namespace)


def test_status_conditions_are_a_map(api: client.ApiClient, namespace: str) -> None:
    """Two conditions of the same type are refused: ``conditions`` is keyed by type."""
    objects = client.CustomObjectsApi(api)
    k = kind_of("TailnetSite")
    sample = copy.deepcopy(next(s for s in load_samples() if s["kind"] == "TailnetSite"))
    sample["metadata"]["name"] = "conditions"
    site = create_object(api, sample)
    try:
        cond = {
            "type": "Ready",
            "status": "Unknown",
            "reason": "Pending",
            "message": "",
            "lastTransitionTime": "2026-01-02T03:04:05Z",
        }
        site["status"] = {"conditions": [cond, dict(cond, status="True")]}
        with pytest.raises(ApiException) as info:
            objects.replace_cluster_custom_object_status(k.group, k.version, k.plural, "conditions", site)
        assert info.value.status == 422
        assert "status.conditions[1]" in info.value.body
    finally:
        _delete(api, "TailnetSite", "conditions", namespace)


def test_wait_established_reports_timeouts(api: client.ApiClient) -> None:
    """The helper polls with a deadline rather than sleeping a fixed time."""
    from hack.crds import wait_established

    started = time.monotonic()
    with pytest.raises(ApiException):
        wait_established(api, ["nonexistent.tailnet.dev"], timeout=1)
    assert time.monotonic() - started < 10
