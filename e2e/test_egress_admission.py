"""TailnetEgress outside the operator namespace, against kube-apiserver and Headscale: the shipped
ValidatingAdmissionPolicy refuses it with a message that says why; without the policy the operator
ignores it and the rendered tailnet policy does not contain its tag."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.controllers.policy import POLICY_KEY, rendered_config_map_name
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import APIError, NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, NAMESPACE, Resource

from .operator import create_bootstrap_secret, running_operator, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

ADMISSION = Path(__file__).resolve().parent.parent / "manifests" / "install" / "admission.yaml"
VAP = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies",
               "ValidatingAdmissionPolicy", namespaced=False)
VAP_BINDING = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
                       "ValidatingAdmissionPolicyBinding", namespaced=False)
BASE = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'


def egress_object(name: str, namespace: str, tailnet: str, tag: str) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": tag, "consumerNamespaces": ["apps"],
                     "targets": [{"name": "db", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}}


def shipped_admission(operator_namespace: str, name: str) -> tuple[JSON, JSON]:
    """The policy and binding of manifests/install, renamed for this test and pointed at its namespace."""
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(ADMISSION.read_text()) if d}
    policy = docs[("ValidatingAdmissionPolicy", "tailnet-egress-operator-namespace")]
    binding = docs[("ValidatingAdmissionPolicyBinding", "tailnet-egress-operator-namespace")]
    policy["metadata"]["name"] = binding["metadata"]["name"] = binding["spec"]["policyName"] = name
    for variable in policy["spec"]["variables"]:
        if variable["name"] == "operatorNamespace":
            variable["expression"] = f"'{operator_namespace}'"
    return policy, binding


@pytest.fixture
async def tenant(admin: Client) -> AsyncIterator[str]:
    name = unique("tenant")
    await admin.create(NAMESPACE, {"metadata": {"name": name}})
    yield name
    await admin.delete(NAMESPACE, name)


async def _refusal(admin: Client, body: JSON) -> str | None:
    """The API's refusal message for creating ``body``, or None when it was stored (then removed)."""
    meta = body["metadata"]
    try:
        await admin.create(TAILNET_EGRESS, body, meta["namespace"])
    except APIError as exc:
        return exc.message
    await admin.delete(TAILNET_EGRESS, meta["name"], meta["namespace"])
    return None


async def test_the_admission_policy_refuses_an_egress_outside_the_operator_namespace(
    admin: Client, operator_namespace: str, tenant: str,
) -> None:
    policy, binding = shipped_admission(operator_namespace, unique("egress-ns"))
    await admin.apply(VAP, policy)
    await admin.apply(VAP_BINDING, binding)
    try:
        outside = egress_object("probe", tenant, "tn", "tag:egress-probe")
        message = await eventually(lambda: _refusal(admin, outside), timeout=30, what="the policy in force")
        assert f"accepted only in the operator namespace {operator_namespace}" in message
        assert f"TailnetEgress probe is in namespace {tenant}" in message
        inside = egress_object("probe", operator_namespace, "tn", "tag:egress-probe")
        assert await _refusal(admin, inside) is None
    finally:
        await admin.delete(VAP_BINDING, binding["metadata"]["name"])
        await admin.delete(VAP, policy["metadata"]["name"])
        # the apiserver drops the policy asynchronously; later tests must not meet it
        await eventually(lambda: _accepted(admin, outside), timeout=30, what="the policy gone")


async def _accepted(admin: Client, body: JSON) -> bool:
    return await _refusal(admin, body) is None


async def test_without_the_admission_policy_the_operator_ignores_a_tenants_egress(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str, tenant: str,
) -> None:
    tailnet = f"{operator_namespace}-tn"
    await create_bootstrap_secret(admin, operator_namespace, "bootstrap", headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": operator_namespace},
                                   "data": {POLICY_KEY: BASE}})
    policy: dict[str, Any] = {"baseConfigMapRef": {"namespace": operator_namespace, "name": "base",
                                                   "key": POLICY_KEY}, "mode": "Render"}
    await admin.create(TAILNET_EGRESS, egress_object("mine", operator_namespace, tailnet, "tag:egress-mine"),
                       operator_namespace)
    await admin.create(TAILNET_EGRESS, egress_object("theirs", tenant, tailnet, "tag:egress-theirs"), tenant)
    try:
        async with running_operator(control_plane.kubeconfig, operator_namespace):
            await admin.create(TAILNET, tailnet_object(tailnet, headscale, operator_namespace, policy=policy))

            async def rendered() -> str | None:
                try:
                    cm = await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), operator_namespace)
                except NotFound:
                    return None
                text = str(cm["data"][POLICY_KEY])
                return text if "tag:egress-mine" in text else None

            text = await eventually(rendered, timeout=60, what="the render with the operator namespace's egress")
            assert "tag:egress-theirs" not in text
    finally:
        for name, namespace in (("mine", operator_namespace), ("theirs", tenant)):
            await admin.delete(TAILNET_EGRESS, name, namespace)
