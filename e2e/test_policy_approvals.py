"""Route approvals follow the rendered policy, and the read-only branches write nothing to Headscale.

Against a real kube-apiserver, Headscale and tailscaled, with the operator's controllers in-process:

1. The base policy assigns one of a site's routes to another approver (``tag:lab-router``). The
   base wins: the router carrying the site's tag advertises the route, and the operator does not
   approve it there; the site's other route, which the render approves for the router's tag, is
   approved. The Tailnet's ``status.policy.skipped`` lists the left-out entry, the PolicyApplied
   message counts it, and a Warning Event ``DerivedEntriesSkipped`` says what to change.
2. Render mode, with a base that would now approve the route for the router's tag: the render is
   published, and neither the live policy nor the router's approved routes change.
3. Without ``spec.policy`` (the operator only reports): the same.
"""

from __future__ import annotations

from typing import Any

import pytest

from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_SITE
from tailnet_operator.controllers.policy import rendered_config_map_name
from tailnet_operator.policy import parse_hujson
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.kinds import CONFIG_MAP, EVENT

from .conftest import TailscaleFactory
from .operator import RunningOperator, create_bootstrap_secret, has_condition, running_operator, tailnet_object, unique
from .polling import eventually

pytestmark = pytest.mark.integration

ROUTER_TAG = "tag:site-shared"
OTHER_TAG = "tag:lab-router"
CONTESTED, FREE = "10.77.0.0/24", "10.78.0.0/24"


def base(headscale: Headscale, *, contested_for: str | None) -> str:
    """Allow-all (grants from Headscale 0.29, acls before); ``CONTESTED`` approved for ``contested_for``."""
    rule = ('"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]' if headscale.minor >= (0, 29)
            else '"acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]')
    approvers = f',\n  "autoApprovers": {{"routes": {{"{CONTESTED}": ["{contested_for}"]}}}}' if contested_for else ""
    return f'{{\n  "tagOwners": {{"{OTHER_TAG}": []}},\n  {rule}{approvers}\n}}\n'


async def put_base(admin: Client, namespace: str, text: str) -> dict[str, Any]:
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                   "data": {"policy.hujson": text}})
    return {"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"}}


def reconciles(op: RunningOperator, controller: str) -> float:
    """Reconciles ``controller`` has finished, whatever their result."""
    return sum(sample.value for metric in op.manager.registry.collect()
               for sample in metric.samples
               if sample.name == "controller_runtime_reconcile_total" and sample.labels.get("controller") == controller)


async def two_more_reconciles(op: RunningOperator, tailnet: str) -> None:
    """Wait until two policy reconciles have finished after this call (the second started after
    the call), so anything the branch under test does has been done."""
    start = reconciles(op, "policy")
    seen = [start]

    def finished() -> bool:
        done = reconciles(op, "policy")
        if done > seen[-1]:  # one finished: ask for the next (a resync would, 30 s later)
            seen.append(done)
            op.poke(tailnet)
        return done >= start + 2

    op.poke(tailnet)
    await eventually(finished, timeout=60, what="two more policy reconciles")


def router_routes(headscale: Headscale, name: str) -> tuple[list[str], list[str]]:
    node = headscale.node_by_name(name)
    assert node is not None, f"{name} is registered"
    return sorted(node.get("availableRoutes") or []), sorted(node.get("approvedRoutes") or [])


async def test_a_route_the_base_assigns_to_another_approver_is_not_approved_and_is_reported(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
    tailscale_nodes: TailscaleFactory,
) -> None:
    namespace = operator_namespace
    tailscale_nodes("shared-router", headscale, authkey=headscale.create_preauth_key(tags=[ROUTER_TAG]),
                    advertise_routes=[CONTESTED, FREE])
    await eventually(lambda: router_routes(headscale, "shared-router")[0] == [CONTESTED, FREE], timeout=60,
                     what="the router advertising both routes")
    assert router_routes(headscale, "shared-router")[1] == [], "nothing is approved before the policy exists"

    tailnet, site = f"{namespace}-tn", unique("shared")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    policy = await put_base(admin, namespace, base(headscale, contested_for=OTHER_TAG))
    async with running_operator(control_plane.kubeconfig, namespace) as op:
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy={**policy, "mode": "Apply"}))
        await admin.create(TAILNET_SITE, {
            "apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": site},
            "spec": {"tailnetRef": {"name": tailnet}, "routes": [CONTESTED, FREE], "routerTag": ROUTER_TAG}})

        # 1. The base wins. The site's status is written after the approvals are replayed, in the
        # same reconcile: once it shows FREE approved, the replay has run.
        async def routers() -> list[JSON] | None:
            found: list[JSON] = ((await admin.get(TAILNET_SITE, site)).get("status") or {}).get("routers") or []
            return found if any(FREE in r["approved"] for r in found) else None

        assert await eventually(routers, timeout=60, what="the site's free route approved") == [
            {"node": "shared-router", "advertised": [CONTESTED, FREE], "approved": [FREE]}]
        assert router_routes(headscale, "shared-router")[1] == [FREE], \
            f"{CONTESTED} is the base's to approve (for {OTHER_TAG}), not the router's"
        live = parse_hujson(headscale.api("GET", "/api/v1/policy")["policy"])
        assert live["autoApprovers"]["routes"][CONTESTED] == [OTHER_TAG]
        assert live["autoApprovers"]["routes"][FREE] == [ROUTER_TAG]

        cond = await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "True", "Applied"),
                                timeout=60, what="the policy applied")
        assert "1 derived entry was left out" in cond["message"]
        [skipped] = (await admin.get(TAILNET, tailnet))["status"]["policy"]["skipped"]
        assert skipped["kind"] == "route" and skipped["entry"] == CONTESTED
        assert skipped["sources"] == [f"TailnetSite {site}"]
        assert OTHER_TAG in skipped["reason"] and ROUTER_TAG in skipped["reason"]

        async def warning() -> JSON | None:
            return next((e for e in (await admin.list(EVENT, "default")).items
                         if e.get("regarding", {}).get("name") == tailnet
                         and e.get("reason") == "DerivedEntriesSkipped"), None)

        event = await eventually(warning, timeout=30, what="the DerivedEntriesSkipped Event")
        assert event["type"] == "Warning"
        assert CONTESTED in event["note"] and f"TailnetSite {site}" in event["note"]
        assert f"ConfigMap {namespace}/base" in event["note"], "the Event names the base to change"

        # 2. Render mode: the base no longer assigns CONTESTED, so a render approves it for the
        # router's tag; nothing of that reaches Headscale.
        await admin.merge_patch(TAILNET, tailnet, {"spec": {"policy": {"mode": "Render"}}})
        await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False", "RenderOnly"),
                         timeout=60, what="RenderOnly")
        await two_more_reconciles(op, tailnet)  # none of Apply mode's is still under way
        written = headscale.api("GET", "/api/v1/policy")
        await put_base(admin, namespace, base(headscale, contested_for=None))

        async def rendered_for_the_router() -> bool:
            cm = await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), namespace)
            routes = parse_hujson(cm["data"]["policy.hujson"]).get("autoApprovers", {}).get("routes", {})
            return bool(routes.get(CONTESTED) == [ROUTER_TAG])

        await eventually(rendered_for_the_router, timeout=60, what="the render approving the route")
        await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False", "RenderOnly"),
                         timeout=60, what="RenderOnly")
        assert "skipped" not in (await admin.get(TAILNET, tailnet))["status"]["policy"]
        await two_more_reconciles(op, tailnet)
        assert headscale.api("GET", "/api/v1/policy") == written, "Render mode wrote the policy"
        assert router_routes(headscale, "shared-router")[1] == [FREE], "Render mode approved a route"

        # 3. No spec.policy: the operator only reads and reports.
        await admin.merge_patch(TAILNET, tailnet, {"spec": {"policy": None}})
        cond = await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False", "PolicyIncomplete"),
                                timeout=60, what="PolicyIncomplete")
        assert CONTESTED in (await admin.get(TAILNET, tailnet))["status"]["policy"]["missing"]
        await two_more_reconciles(op, tailnet)
        assert headscale.api("GET", "/api/v1/policy") == written, "the report-only branch wrote the policy"
        assert router_routes(headscale, "shared-router")[1] == [FREE], "the report-only branch approved a route"
