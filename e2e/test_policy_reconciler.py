"""The Policy reconciler and TailnetSite status against kube-apiserver, Headscale and tailscaled."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hack.localenv import ControlPlane, Headscale, HeadscaleError, SiteHost
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_SITE
from tailnet_operator.controllers.policy import rendered_config_map_name
from tailnet_operator.policy import parse_hujson
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP

from .conftest import TailscaleFactory
from .operator import (
    create_bootstrap_secret,
    has_condition,
    running_operator,
    tailnet_object,
    unique,
)
from .polling import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def namespace(operator_namespace: str) -> str:
    return operator_namespace

OPEN_BASE = """// Everyone may reach everything; the operator adds tag owners and route approvers.
{
  "grants": [
    {"src": ["*"], "dst": ["*"], "ip": ["*"]},  // trailing commas and comments are HuJSON
  ],
}
"""

OPEN_ACL_BASE = """// The same as OPEN_BASE for a Headscale without grants (before 0.29).
{
  "acls": [
    {"action": "accept", "src": ["*"], "dst": ["*:*"]},
  ],
}
"""


def open_base(headscale: Headscale) -> str:
    """An allow-all base the server understands: grants from Headscale 0.29, acls before."""
    return OPEN_BASE if headscale.minor >= (0, 29) else OPEN_ACL_BASE






async def base_policy(admin: Client, namespace: str, text: str) -> dict[str, Any]:
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": namespace},
                                   "data": {"policy.hujson": text}})
    return {"baseConfigMapRef": {"namespace": namespace, "name": "base", "key": "policy.hujson"}}


def site_object(name: str, tailnet: str, routes: list[str], tag: str) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetSite", "metadata": {"name": name},
            "spec": {"tailnetRef": {"name": tailnet}, "routes": routes, "routerTag": tag}}


def get_via(proxy: str, url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    with opener.open(url, timeout=5) as resp:
        return str(resp.read().decode())


async def test_a_route_advertised_before_its_site_existed_is_approved_and_carries_traffic(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str,
    tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost],
) -> None:
    host = site_host()
    host.serve_http(8080)
    tag = "tag:site-branch"
    router_key = headscale.create_preauth_key(tags=[tag])
    router = tailscale_nodes("branch-router", headscale, authkey=router_key, advertise_routes=[host.subnet],
                             site_router=True)
    node = headscale.node_by_name("branch-router")
    assert node is not None and host.subnet in node["availableRoutes"] and not node.get("approvedRoutes")

    tailnet, site = f"{namespace}-tn", unique("branch")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    policy = await base_policy(admin, namespace, open_base(headscale))
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy={**policy, "mode": "Apply"}))
        await admin.create(TAILNET_SITE, site_object(site, tailnet, [host.subnet], tag))
        await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "True", "Applied"), timeout=60,
                         what="the policy applied")
        await eventually(has_condition(admin, TAILNET_SITE, site, "Ready", "True", "Routed"), timeout=60,
                         what="the site Approved and Ready")

        node = headscale.node_by_name("branch-router")
        assert node is not None and host.subnet in node["approvedRoutes"]
        live = parse_hujson(headscale.api("GET", "/api/v1/policy")["policy"])
        assert live["autoApprovers"]["routes"][host.subnet] == [tag]
        status = (await admin.get(TAILNET_SITE, site))["status"]
        assert status["routers"] == [{"node": "branch-router", "advertised": [host.subnet],
                                      "approved": [host.subnet]}]

        user = headscale.create_user("laptop-owner")
        laptop = tailscale_nodes("laptop", headscale, authkey=headscale.create_preauth_key(user_id=user["id"]),
                                 accept_routes=True)
        url = f"http://{host.address}:8080/through-the-site"
        body = await eventually(lambda: _try(lambda: get_via(laptop.http_proxy, url)), timeout=30,
                                what="the laptop to reach the host behind the router")
        assert body == f"hello from {host.address}:8080 path /through-the-site\n"
        assert router.sees("laptop")


COMMENTED_BASE = """// The platform team's policy: read this before editing.
{
  "tagOwners": {
    "tag:site-ours": [] // the lab's router
  },
  /* Who may reach what. */
  "RULES": [
    RULE, // everyone, for now
  ],
  // Routers: the operator adds its own approvals below ours.
  "autoApprovers": {
    "routes": {
      "10.99.0.0/16": ["tag:site-ours"], // the lab, approved by hand
    },
  },
}
"""


def _subsequence(short: str, long: str) -> bool:
    chars = iter(long)
    return all(char in chars for char in short)


async def test_the_live_policy_keeps_the_base_comments_and_marks_what_the_operator_added(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    tailnet, first, second = f"{namespace}-tn", unique("first"), unique("second")
    grants = headscale.minor >= (0, 29)
    base = COMMENTED_BASE.replace("RULES", "grants" if grants else "acls").replace(
        "RULE", '{"src": ["*"], "dst": ["*"], "ip": ["*"]}' if grants else
        '{"action": "accept", "src": ["*"], "dst": ["*:*"]}')
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    policy = await base_policy(admin, namespace, base)

    def live() -> str:
        return str(headscale.api("GET", "/api/v1/policy")["policy"])

    def live_with(text: str) -> Callable[[], Awaitable[str | None]]:
        async def check() -> str | None:
            try:
                current = live()
            except HeadscaleError:  # no policy stored yet
                return None
            return current if text in current else None
        return check

    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy={**policy, "mode": "Apply"}))
        await admin.create(TAILNET_SITE, site_object(first, tailnet, ["192.168.81.0/24"], "tag:site-first"))
        text = await eventually(live_with(f"// tailnet-operator: derived from TailnetSite {first}\n"), timeout=60,
                                what="the live policy with the first site's entries")
        # Headscale stored the render as written: the base byte for byte, the operator's entries inserted.
        assert _subsequence(base, text)
        assert text.startswith("// The platform team's policy: read this before editing.\n{\n"
                               '  "tagOwners": {\n    "tag:site-ours": [], // the lab\'s router\n')
        assert '"10.99.0.0/16": ["tag:site-ours"], // the lab, approved by hand\n' in text
        rendered = await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), namespace)
        assert rendered["data"]["policy.hujson"] == text
        document = parse_hujson(text)
        assert document["autoApprovers"]["routes"]["192.168.81.0/24"] == ["tag:site-first"]
        assert document["tagOwners"]["tag:site-first"] == []
        await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "True", "Applied"), timeout=60,
                         what="PolicyApplied")

        # Another site: its entries are inserted after the first site's; everything before stays.
        await admin.create(TAILNET_SITE, site_object(second, tailnet, ["192.168.82.0/24"], "tag:site-second"))
        text = await eventually(live_with(f"// tailnet-operator: derived from TailnetSite {second}\n"), timeout=60,
                                what="the live policy with the second site's entries")
        assert _subsequence(base, text)
        assert text.index(f"TailnetSite {first}\n") < text.index(f"TailnetSite {second}\n")

        # A comment-only change of the base is published but not written: Headscale compares nothing,
        # the operator compares data, and the data is the same.
        updated = str(headscale.api("GET", "/api/v1/policy")["updatedAt"])
        await base_policy(admin, namespace, base.replace("read this before editing", "edited by Alice"))

        async def republished() -> str | None:
            cm = await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), namespace)
            published = str(cm["data"]["policy.hujson"])
            return published if "edited by Alice" in published else None

        await eventually(republished, timeout=60, what="the render of the edited base published")
        assert live() == text
        assert str(headscale.api("GET", "/api/v1/policy")["updatedAt"]) == updated


def _try(fn: Callable[[], str]) -> str | None:
    try:
        return fn()
    except OSError:
        return None


async def test_the_younger_overlapping_site_is_blocked_until_the_older_is_deleted(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    tailnet = f"{namespace}-tn"
    old, young, reserved = unique("old"), unique("young"), unique("reserved")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, reservedNetworks=["10.96.0.0/12"]))
        await admin.create(TAILNET_SITE, site_object(old, tailnet, ["192.168.50.0/24"], "tag:site-old"))
        await eventually(has_condition(admin, TAILNET_SITE, old, "Blocked", "False"), what="the older site")
        await admin.create(TAILNET_SITE, site_object(young, tailnet, ["192.168.50.128/25"], "tag:site-young"))
        await admin.create(TAILNET_SITE, site_object(reserved, tailnet, ["10.96.4.0/24"], "tag:site-reserved"))

        blocked = await eventually(has_condition(admin, TAILNET_SITE, young, "Blocked", "True", "RoutesOverlap"),
                                   what="the younger site blocked")
        assert old in blocked["message"]
        assert (await admin.get(TAILNET_SITE, young))["status"]["blockedBy"] == f"TailnetSite {old}"
        cond = await eventually(has_condition(admin, TAILNET_SITE, reserved, "Blocked", "True"),
                                what="the site in a reserved network blocked")
        assert "10.96.0.0/12" in cond["message"]
        assert (await admin.get(TAILNET_SITE, old))["status"]["conditions"]

        await admin.delete(TAILNET_SITE, old)
        await eventually(has_condition(admin, TAILNET_SITE, young, "Blocked", "False"), what="unblocked")
        assert "blockedBy" not in (await admin.get(TAILNET_SITE, young))["status"]


async def test_a_base_whose_own_tests_fail_is_published_but_never_written(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    tailnet = f"{namespace}-tn"
    before = headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(
        {"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]})})["policy"]
    failing = """{
      "tagOwners": {"tag:web": [], "tag:db": []},
      "grants": [{"src": ["tag:web"], "dst": ["tag:web"], "ip": ["tcp:443"]}],
      // web may not reach db, so this test of the base fails
      "tests": [{"src": "tag:web", "accept": ["tag:db:5432"]}],
    }"""
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    policy = await base_policy(admin, namespace, failing)
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy={**policy, "mode": "Apply"}))
        cond = await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False", "PolicyRejected"),
                                timeout=60, what="PolicyRejected")
        assert "the live policy is unchanged" in cond["message"]
        assert len(cond["message"]) > len("Headscale refused the render ")
        rendered = await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), namespace)
        assert '"tests"' in rendered["data"]["policy.hujson"]
        status = (await admin.get(TAILNET, tailnet))["status"]["policy"]
        assert status["renderedHash"] == rendered["metadata"]["annotations"]["tailnet.dev/policy-hash"]
        assert "appliedHash" not in status
    assert headscale.api("GET", "/api/v1/policy")["policy"] == before


async def test_without_spec_policy_the_operator_reports_what_is_missing(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    tailnet, site = f"{namespace}-tn", unique("site")
    headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(
        {"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]})})
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace))
        await admin.create(TAILNET_SITE, site_object(site, tailnet, ["192.168.70.0/24"], "tag:site-report"))
        await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False", "PolicyIncomplete"),
                         timeout=60, what="PolicyIncomplete")
        status = (await admin.get(TAILNET, tailnet))["status"]["policy"]
        assert "tag:site-report" in status["missingTags"]
        assert "192.168.70.0/24" in status["missing"] and "autoApprovers" in status["missing"]
    try:
        await admin.get(CONFIG_MAP, rendered_config_map_name(tailnet), namespace)
        raise AssertionError("nothing is rendered when the operator does not own the policy")
    except NotFound:
        pass
