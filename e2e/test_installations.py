"""Two installations of the operator share one Headscale, and neither touches the other's keys or nodes.

Two clusters (two kube-apiservers, each with its own etcd), each with the operator's controllers
in-process, in a namespace of the same name and with a Tailnet of the same name, both pointing at
one real Headscale; real tailscaled nodes join with the keys the operators minted. In each
cluster one TailnetEgress stays and one is deleted with ``tailnet.dev/skip-cleanup`` (its key,
and in the first cluster its node, stay behind). With both operators' clocks moved past the
sweep's grace, each sweep removes its own installation's leftovers and nothing of the other's:
its live keys stay valid and its nodes stay registered.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import pytest

from hack.crds import install_crds
from hack.localenv import ControlPlane, Environment, Headscale
from tailnet_operator.controllers.cleanup import SKIP_CLEANUP_ANNOTATION
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import JSON, Client
from tailnet_operator.runtime.errors import NotFound
from tailnet_operator.runtime.kinds import NAMESPACE, SECRET

from .conftest import TailscaleFactory
from .operator import (
    RunningOperator,
    ShiftedClock,
    create_bootstrap_secret,
    has_condition,
    running_operator,
    tailnet_object,
)
from .polling import eventually

pytestmark = pytest.mark.integration

EGRESSES = {"first": ("a-kept", "a-gone"), "second": ("b-kept", "b-gone")}
"""Per cluster: the egress that stays, and the one deleted with skip-cleanup."""
NODES = ("a-kept", "a-gone", "b-kept")


def _egress(name: str, tailnet: str, namespace: str) -> JSON:
    return {"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetEgress",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": f"tag:egress-{name}", "consumerNamespaces": [namespace],
                     "targets": [{"name": f"db-{name}", "address": "198.18.5.5", "ports": [{"port": 5432}]}]}}


@pytest.fixture
def second_cluster(environment: Environment) -> Iterator[ControlPlane]:
    """Another cluster: its own etcd and kube-apiserver, with the project's CRDs."""
    plane = environment.control_plane()
    try:
        install_crds(plane.api_client())
        yield plane
    finally:
        plane.stop()


@asynccontextmanager
async def _admin(plane: ControlPlane) -> AsyncIterator[Client]:
    async with Client(rest_config.load(plane.kubeconfig), field_manager="test-admin") as client:
        yield client


async def _secret(admin: Client, egress: str, namespace: str) -> JSON | None:
    try:
        return await admin.get(SECRET, auth_key_secret_name("TailnetEgress", egress), namespace)
    except NotFound:
        return None


def _sweeps(op: RunningOperator) -> float:
    return op.manager.registry.get_sample_value("tailnet_operator_orphan_sweeps_total", {"result": "ok"}) or 0.0


async def test_two_installations_on_one_headscale_sweep_only_their_own(
    admin: Client, control_plane: ControlPlane, second_cluster: ControlPlane, headscale: Headscale,
    operator_namespace: str, tailscale_nodes: TailscaleFactory,
) -> None:
    ns = operator_namespace
    tailnet = f"{ns}-tn"
    tags: dict[str, list[str]] = {f"tag:egress-{name}": [] for pair in EGRESSES.values() for name in pair}
    # the policy is set by hand (both Tailnets only read it): it owns every egress's tag
    headscale.api("PUT", "/api/v1/policy", {"policy": json.dumps(
        {"tagOwners": tags, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]})})

    def keys() -> dict[str, JSON]:
        return {k["id"]: k for k in headscale.api("GET", "/api/v1/preauthkey")["preAuthKeys"]}

    def expired(key_id: str) -> bool:
        return datetime.fromisoformat(keys()[key_id]["expiration"].replace("Z", "+00:00")) <= datetime.now(UTC)

    async with _admin(second_cluster) as admin_b:
        await admin_b.create(NAMESPACE, {"metadata": {"name": ns}})  # the same namespace name in both clusters
        admins = {"first": admin, "second": admin_b}
        planes = {"first": control_plane, "second": second_cluster}
        clocks = {cluster: ShiftedClock() for cluster in planes}
        for client in admins.values():
            await create_bootstrap_secret(client, ns, "bootstrap", headscale.api_key)

        async with running_operator(planes["first"].kubeconfig, ns, clock=clocks["first"]) as first, \
                running_operator(planes["second"].kubeconfig, ns, clock=clocks["second"]) as second:
            ops = {"first": first, "second": second}
            uids = {}
            for cluster, client in admins.items():
                created = await client.create(TAILNET, tailnet_object(tailnet, headscale, ns))
                uids[cluster] = created["metadata"]["uid"]
                await eventually(has_condition(client, TAILNET, tailnet, "Ready", "True"), timeout=60,
                                 what=f"the {cluster} cluster's Tailnet Ready")
                for name in EGRESSES[cluster]:
                    await client.create(TAILNET_EGRESS, _egress(name, tailnet, ns), ns)

            secrets: dict[str, JSON] = {}
            for cluster, client in admins.items():
                for name in EGRESSES[cluster]:
                    secrets[name] = await eventually(lambda c=client, n=name: _secret(c, n, ns),  # type: ignore[misc]
                                                     timeout=60, what=f"the pre-auth key of {name}")
            ids = {name: s["metadata"]["annotations"]["tailnet.dev/key-id"] for name, s in secrets.items()}
            for name in NODES:
                tailscale_nodes(name, headscale, authkey=base64.b64decode(secrets[name]["data"]["authKey"]).decode())
                await eventually(lambda n=name: headscale.node_by_name(n), timeout=60,  # type: ignore[misc]
                                 what=f"{name} registered")

            # each cluster's "gone" egress goes without its cleanup: its key (and a-gone's node) stay
            for cluster, client in admins.items():
                gone = EGRESSES[cluster][1]
                await client.merge_patch(TAILNET_EGRESS, gone,
                                         {"metadata": {"annotations": {SKIP_CLEANUP_ANNOTATION: "true"}}}, ns)
                await client.delete(TAILNET_EGRESS, gone, ns)

            async def gone_from(client: Client, name: str) -> bool:
                try:
                    await client.get(TAILNET_EGRESS, name, ns)
                except NotFound:
                    return True
                return False

            for cluster, client in admins.items():
                await eventually(lambda c=client, n=EGRESSES[cluster][1]: gone_from(c, n),  # type: ignore[misc]
                                 timeout=30, what=f"{EGRESSES[cluster][1]} deleted")
            assert not any(expired(key_id) for key_id in ids.values()), "skip-cleanup expired nothing"

            # past the sweep's grace, both installations sweep, each at least twice
            for clock in clocks.values():
                clock.offset = timedelta(minutes=11)
            before = {cluster: _sweeps(op) for cluster, op in ops.items()}
            last_poke = [0.0]

            def swept() -> bool:
                now = asyncio.get_running_loop().time()
                if now - last_poke[0] > 2:  # as the sweep's own requeue would, without waiting 10 minutes
                    last_poke[0] = now
                    for op in ops.values():
                        op.poke(tailnet)
                return all(_sweeps(op) >= before[cluster] + 2 for cluster, op in ops.items())

            await eventually(swept, timeout=90, what="two sweeps by each installation")

            assert not expired(ids["a-kept"]), "the first cluster's live key was expired"
            assert not expired(ids["b-kept"]), "the second cluster's live key was expired by the first's sweep"
            assert headscale.node_by_name("a-kept") is not None, "the first cluster's node was deleted"
            assert headscale.node_by_name("b-kept") is not None, "the second cluster's node was deleted"
            assert expired(ids["a-gone"]) and expired(ids["b-gone"]), "each sweep removes its own leftovers"
            assert headscale.node_by_name("a-gone") is None

            # each installation's marker: tag:tailnet-operator- and 16 hex digits of its Tailnet's uid
            markers = {cluster: f"tag:tailnet-operator-{uid.replace('-', '')[:16]}" for cluster, uid in uids.items()}
            assert markers["first"] != markers["second"]
            assert all(re.fullmatch(r"tag:tailnet-operator-[0-9a-f]{16}", m) for m in markers.values())
            for cluster, (kept, gone) in EGRESSES.items():
                for name in (kept, gone):
                    assert keys()[ids[name]]["aclTags"] == [f"tag:egress-{name}", markers[cluster]]
