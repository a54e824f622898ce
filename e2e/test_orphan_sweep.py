"""The finalizers' skip annotation and bound, and the orphan sweep, with the operator's controllers
in-process against a real kube-apiserver, a real Headscale v0.29.2 and a real tailscaled.

1. A TailnetEgress gets its pre-auth key; a node joins with it (as the agent pod would).
2. The egress is deleted with ``tailnet.dev/skip-cleanup: "true"``: it goes at once, its key and
   node stay in Headscale (``CleanupSkipped``).
3. The orphan sweep, once they are older than its grace (the operator's clock moved 11 minutes on),
   expires the key and deletes the node, and leaves another egress's key and node and a key
   made by hand alone (``OrphansSwept`` on the Tailnet).
4. With Headscale stopped, deleting an egress retries, then lets go after the bound with
   ``PreAuthKeyNotExpired`` (the clock moved past 5 minutes).
"""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from e2e.conftest import TailscaleFactory
from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.cleanup import SKIP_CLEANUP_ANNOTATION
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.controllers.pipeline import TaggedNodeReconciler
from tailnet_operator.headscale import installation_tag
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.runtime import Result
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.controller import Request
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import CONFIG_MAP, EVENT, SECRET
from tailnet_operator.types import JSON

from .operator import ShiftedClock, create_bootstrap_secret, has_condition, running_operator, tailnet_object
from .polling import eventually

pytestmark = pytest.mark.integration

BASE = '{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'


def _egress(name: str, tailnet: str, namespace: str) -> dict[str, object]:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": f"tag:egress-{name}", "consumerNamespaces": [namespace],
                     "targets": [{"name": f"db-{name}", "address": "198.18.5.5", "ports": [{"port": 5432}]}]}}


async def _key_id(admin: Client, egress: str, namespace: str) -> str | None:
    try:
        secret = await admin.get(SECRET, auth_key_secret_name("TailnetEgress", egress), namespace)
    except NotFound:
        return None
    return (secret["metadata"].get("annotations") or {}).get("tailnet.dev/key-id")


async def _reasons(admin: Client, namespace: str, name: str) -> set[str]:
    events = await admin.list(EVENT, namespace)
    return {e["reason"] for e in events.items if e.get("regarding", {}).get("name") == name}


async def _has(admin: Client, namespace: str, name: str, reason: str) -> bool:
    return reason in await _reasons(admin, namespace, name)


async def _gone(admin: Client, egress: str, namespace: str) -> bool:
    try:
        await admin.get(TAILNET_EGRESS, egress, namespace)
    except NotFound:
        return True
    return False


async def test_skip_cleanup_then_the_sweep_and_the_bounded_finalizer(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, operator_namespace: str,
    tailscale_nodes: TailscaleFactory,
) -> None:
    ns = operator_namespace
    tailnet = f"{ns}-tn"
    clock = ShiftedClock()
    await create_bootstrap_secret(admin, ns, "bootstrap", headscale.api_key)
    await admin.apply(CONFIG_MAP, {"metadata": {"name": "base", "namespace": ns}, "data": {"policy.hujson": BASE}})
    policy = {"baseConfigMapRef": {"namespace": ns, "name": "base", "key": "policy.hujson"}, "mode": "Apply"}
    def expired(key_id: str) -> bool:
        [key] = [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"] if k["id"] == key_id]
        return datetime.fromisoformat(key["expiration"].replace("Z", "+00:00")) <= datetime.now(UTC)

    by_hand = headscale.create_preauth_key(tags=["tag:egress-gone"], reusable=True, ephemeral=True)

    async with running_operator(control_plane.kubeconfig, ns, clock=clock) as op:
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, ns, policy=policy))
        await eventually(has_condition(admin, TAILNET, tailnet, "Ready", "True"), timeout=60, what="Ready")
        for name in ("gone", "kept", "stuck"):
            await admin.create(TAILNET_EGRESS, _egress(name, tailnet, ns), ns)
        ids = {}
        for name in ("gone", "kept", "stuck"):
            ids[name] = await eventually(lambda n=name: _key_id(admin, n, ns), timeout=60,  # type: ignore[misc]
                                         what=f"the pre-auth key of {name}")
        keys = {k["id"]: k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]}
        marker = installation_tag((await admin.get(TAILNET, tailnet))["metadata"]["uid"])
        assert keys[ids["gone"]]["aclTags"] == ["tag:egress-gone", marker]
        for name in ("gone", "kept"):
            secret = await admin.get(SECRET, auth_key_secret_name("TailnetEgress", name), ns)
            tailscale_nodes(f"agent-{name}", headscale, authkey=base64.b64decode(secret["data"]["authKey"]).decode())
            await eventually(lambda n=name: headscale.node_by_name(f"agent-{n}"), timeout=60,  # type: ignore[misc]
                             what=f"agent-{name} registered")
        tailscale_nodes("by-hand", headscale, authkey=by_hand)
        await eventually(lambda: headscale.node_by_name("by-hand"), timeout=60, what="by-hand registered")

        # 2. skipped: gone at once, its key still valid in Headscale
        skip = {"metadata": {"annotations": {SKIP_CLEANUP_ANNOTATION: "true"}}}
        await admin.merge_patch(TAILNET_EGRESS, "gone", skip, ns)
        await admin.delete(TAILNET_EGRESS, "gone", ns)
        await eventually(lambda: _gone(admin, "gone", ns), timeout=30, what="the egress gone")
        await eventually(lambda: _has(admin, ns, "gone", "CleanupSkipped"), timeout=30, what="CleanupSkipped")
        assert not expired(ids["gone"]) and "PreAuthKeyExpired" not in await _reasons(admin, ns, "gone")

        # 3. the sweep, past its grace
        clock.offset = timedelta(minutes=11)
        op.poke(tailnet)

        pokes = [0.0]

        async def swept() -> bool:
            now = asyncio.get_running_loop().time()
            if now - pokes[0] > 3:  # as the sweep's own requeue would, without waiting 10 minutes
                pokes[0] = now
                op.poke(tailnet)
            return expired(ids["gone"]) and headscale.node_by_name("agent-gone") is None

        await eventually(swept, timeout=60, what="the gone egress's key expired and node deleted")
        assert headscale.node_by_name("agent-kept") is not None and headscale.node_by_name("by-hand") is not None
        assert not expired(ids["kept"]) and not expired(ids["stuck"])
        assert not [k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]
                    if marker not in k["aclTags"] and expired(k["id"])], "a key made by hand was expired"
        await eventually(lambda: _has(admin, "default", tailnet, "OrphansSwept"), timeout=30, what="OrphansSwept")

        # 4. Headscale down: the finalizer retries, then lets go after the bound
        egress_controller = next(c for c in op.manager.controllers if c.name == "egress")
        reconciler = egress_controller.reconciler
        assert isinstance(reconciler, TaggedNodeReconciler)
        attempts: list[Result | None] = []
        run = reconciler.phases.cleanup.run

        async def counted(obj: JSON, *args: Any, **kwargs: Any) -> Result | None:
            outcome = await run(obj, *args, **kwargs)
            if obj["metadata"]["name"] == "stuck":
                attempts.append(outcome)
            return outcome

        reconciler.phases.cleanup.run = counted  # type: ignore[method-assign]
        clock.offset = timedelta(0)  # the bound counts from the deletion on the operator's clock
        headscale.stop()
        await admin.delete(TAILNET_EGRESS, "stuck", ns)
        await eventually(lambda: attempts, timeout=60, what="the finalizer tried to expire the key")
        assert attempts[0] is not None and attempts[0].requeue_after == 10.0, "a failed attempt is retried"
        assert not await _gone(admin, "stuck", ns), "Headscale is down: the finalizer holds the egress"
        clock.offset = timedelta(minutes=5, seconds=30)
        egress_controller.queue.add(Request(ns, "stuck"))
        await eventually(lambda: _gone(admin, "stuck", ns), timeout=60, what="the egress let go after the bound")
        await eventually(lambda: _has(admin, ns, "stuck", "PreAuthKeyNotExpired"), timeout=30,
                         what="PreAuthKeyNotExpired")
