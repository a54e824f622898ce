"""The Gateway reconciler on the fake client and a fake Headscale: suspended, created exactly once
(with the router's own ServiceAccount and Role), receipts from the registered node, fresh-only (a
foreign state Secret, a gone node), following the operator's image into an OnDelete template (never
the TailnetGateway's), and the two deletion policies."""

from __future__ import annotations

import copy
from typing import Any

from tailnet_operator.controllers.gateway import GatewayReconciler, GatewaySettings
from tailnet_operator.controllers.kinds import TAILNET_EGRESS, TAILNET_GATEWAY
from tailnet_operator.controllers.periods import AGENT_RESYNC as RESYNC_SECONDS
from tailnet_operator.controllers.periods import GATEWAY_SETTLING as SETTLING_SECONDS
from tailnet_operator.headscale import installation_tag
from tailnet_operator.names import FINALIZER
from tailnet_operator.runtime import CONFIG_MAP, SECRET, SERVICE, Applier, Request, Result
from tailnet_operator.runtime.kinds import DEPLOYMENT, POD, ROLE, ROLE_BINDING, SERVICE_ACCOUNT, STATEFUL_SET
from tailnet_operator.types import JSON

from .harness import NAMESPACE, World

GW_NS = "tailnet-gateway"
IMAGE = "registry.example/tailscale:v1.98.10"
"""The operator's router image (its configuration)."""
DNS_IP = "10.96.0.53"
OWNING = ('{"tagOwners": {"tag:gateway": [], "tag:egress-db": []}, '
          '"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
HOSTS = "# hosts\n10.96.7.7 db.corp.example\n"


class GatewayWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.gateway = self.reconciler(IMAGE)

    def reconciler(self, image: str) -> GatewayReconciler:
        """The Gateway reconciler of an operator configured with the router image ``image``."""
        return GatewayReconciler(self.deps, Applier(self.kube, self.kube, field_manager="tailnet-operator-gateway"),
                                 GatewaySettings(namespace=GW_NS, router_image=image))

    async def reconcile_gateway(self, name: str = "edge") -> Result:
        return await self.gateway.reconcile(Request("", name))

    def add_gateway(self, name: str = "edge", **spec: Any) -> JSON:
        body = {"tailnetRef": {"name": "tn"}, "tag": "tag:gateway",
                "siteRoutes": ["192.168.10.0/24"], "advertiseLoadBalancerRange": "10.250.0.0/24",
                "dns": {"zone": "corp.example", "image": "registry.k8s.io/coredns/coredns:v1.12.1"}, **spec}
        return self.kube.add(TAILNET_GATEWAY, {"metadata": {"name": name}, "spec": body})

    def obj(self, name: str = "edge") -> JSON:
        obj = self.kube.get(TAILNET_GATEWAY, name)
        assert obj is not None
        return obj

    def cond(self, type_: str, name: str = "edge") -> JSON:
        return next((c for c in (self.obj(name).get("status") or {}).get("conditions") or []
                     if c["type"] == type_), {})

    def edit_spec(self, name: str = "edge", **spec: Any) -> None:
        obj = copy.deepcopy(self.obj(name))
        obj["spec"].update(spec)
        self.kube.update(TAILNET_GATEWAY, obj)

    def dns_service_gets_address(self) -> None:
        """What kube-apiserver does: the CoreDNS Service gets a ClusterIP."""
        self.kube.add(SERVICE, {"metadata": {"name": "edge-gateway-dns", "namespace": GW_NS},
                                "spec": {"clusterIP": DNS_IP}})

    def register(self, node_id: str = "41", *, online: bool = True, key_id: str | None = None) -> JSON:
        """A router node registering with the gateway's pre-auth key, as tailscaled does."""
        keys = [k for k in self.headscale.preauth_keys.values() if "tag:gateway" in k["aclTags"]]
        sts = self.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
        assert sts is not None
        routes = next(e["value"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
                      if e["name"] == "TS_ROUTES").split(",")
        node = {"id": node_id, "name": "edge-gateway", "tags": ["tag:gateway"], "online": online,
                "nodeKey": "nodekey:0123abcd", "createdAt": "2026-01-01T00:00:05Z",
                "availableRoutes": routes, "approvedRoutes": [r for r in routes if r != f"{DNS_IP}/32"],
                "preAuthKey": {"id": key_id or keys[-1]["id"]}}
        self.headscale.nodes.append(node)
        return node

    def pod_from_template(self) -> None:
        """What the StatefulSet controller does: a pod from the current template."""
        sts = self.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
        assert sts is not None
        template = sts["spec"]["template"]
        self.kube.add(POD, {"metadata": {"name": "edge-gateway-0", "namespace": GW_NS,
                                         **copy.deepcopy(template["metadata"])}, "spec": template["spec"]})

    def snapshot(self) -> dict[tuple[str, str], str]:
        """resourceVersion of every object of the gateway namespace."""
        out = {}
        for resource in (SECRET, CONFIG_MAP, SERVICE, DEPLOYMENT, STATEFUL_SET, POD, SERVICE_ACCOUNT, ROLE,
                         ROLE_BINDING):
            for o in self.kube.list(resource, GW_NS):
                out[(resource.kind, o["metadata"]["name"])] = o["metadata"]["resourceVersion"]
        return out


async def ready_world(policy: str = OWNING) -> GatewayWorld:
    world = GatewayWorld()
    world.bootstrap_secret()
    world.add_tailnet(dns={"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"},
                           "zones": ["corp.example"]})
    world.kube.add(CONFIG_MAP, {"metadata": {"name": "tailnet-hosts", "namespace": "kube-system"},
                                "data": {"hosts": HOSTS}})
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    return world


async def created_world() -> GatewayWorld:
    """Unsuspended, the CoreDNS Service has its address, the router objects exist."""
    world = await ready_world()
    world.dns_service_gets_address()
    world.add_gateway(suspend=False)
    await world.reconcile_gateway()
    return world


async def registered_world() -> GatewayWorld:
    world = await created_world()
    world.register()
    await world.reconcile_gateway()
    return world


# -- suspended ------------------------------------------------------------------------------------


async def test_a_suspended_gateway_creates_nothing_and_says_so() -> None:
    world = await ready_world()
    world.add_gateway()  # suspend defaults to true

    await world.reconcile_gateway()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "Suspended")
    assert "nothing is created" in ready["message"]
    assert world.snapshot() == {}
    assert world.headscale.preauth_keys == {}
    assert FINALIZER not in (world.obj()["metadata"].get("finalizers") or [])


# -- creation -------------------------------------------------------------------------------------


async def test_unsuspending_mints_a_single_use_key_and_creates_the_router_and_the_zone() -> None:
    world = await ready_world()
    world.dns_service_gets_address()
    world.add_gateway(suspend=False)

    await world.reconcile_gateway()

    [key] = world.headscale.preauth_keys.values()
    marker = installation_tag(world.tailnet_obj()["metadata"]["uid"])
    assert key["aclTags"] == ["tag:gateway", marker] and not key["reusable"] and not key["ephemeral"]
    state = world.kube.get(SECRET, "edge-gateway-state", GW_NS)
    assert state is not None and not state.get("data")
    assert state["metadata"]["annotations"]["tailnet.dev/gateway-uid"] == world.obj()["metadata"]["uid"]
    assert "ownerReferences" not in state["metadata"], "the garbage collector must never remove the router"
    auth = world.kube.get(SECRET, "edge-gateway-auth-key", GW_NS)
    assert auth is not None and auth["data"]["authKey"]
    sts = world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
    assert sts is not None and sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TS_ROUTES"] == "10.96.0.53/32,10.250.0.0/24,192.168.10.0/24"
    assert env["TS_KUBE_SECRET"] == "edge-gateway-state"
    zone = world.kube.get(CONFIG_MAP, "edge-gateway", GW_NS)
    assert zone is not None and "db.corp.example. 30 IN A 10.96.7.7" in zone["data"]["zone.db"]
    assert "corp.example:1053" in zone["data"]["Corefile"]
    for resource, name in ((DEPLOYMENT, "edge-gateway-dns"), (SERVICE, "edge-gateway"), (SERVICE, "edge-gateway-dns")):
        assert world.kube.get(resource, name, GW_NS) is not None, (resource, name)
    pod = sts["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == IMAGE and "initContainers" not in pod
    assert pod["serviceAccountName"] == "edge-gateway"
    assert world.kube.get(SERVICE_ACCOUNT, "edge-gateway", GW_NS) is not None
    role = world.kube.get(ROLE, "edge-gateway", GW_NS)
    assert role is not None and role["rules"][0]["resourceNames"] == ["edge-gateway-state"]
    binding = world.kube.get(ROLE_BINDING, "edge-gateway", GW_NS)
    assert binding is not None and binding["subjects"][0]["name"] == "edge-gateway"
    assert FINALIZER in world.obj()["metadata"]["finalizers"]
    registered = world.cond("Registered")
    assert (registered["status"], registered["reason"]) == ("False", "Registering")
    assert world.obj()["status"]["dns"] == {"zone": "corp.example", "serverAddress": DNS_IP}
    assert "receipts" not in world.obj()["status"]
    assert world.events.reasons[-2:] == ["Creating", "PreAuthKeyRotated"]
    assert state["metadata"]["annotations"]["tailnet.dev/pre-auth-key-ids"] == key["id"]


async def test_the_router_waits_for_the_dns_address_so_its_template_does_not_change_after_creation() -> None:
    world = await ready_world()
    world.add_gateway(suspend=False)

    await world.reconcile_gateway()

    assert world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS) is None
    assert "CoreDNS Service's address" in world.cond("Registered")["message"]
    world.kube.update(SERVICE, {**world.kube.get(SERVICE, "edge-gateway-dns", GW_NS),  # type: ignore[dict-item]
                                "spec": {"clusterIP": DNS_IP, "ports": []}})
    await world.reconcile_gateway()
    assert world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS) is not None
    assert len(world.headscale.preauth_keys) == 1


async def test_every_egress_target_given_by_ip_is_advertised_as_a_host_route() -> None:
    world = await ready_world()
    world.dns_service_gets_address()
    world.kube.add(TAILNET_EGRESS, {"metadata": {"name": "db", "namespace": NAMESPACE}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "ledger", "address": "198.18.1.10", "ports": [{"port": 5432}]},
                    {"name": "named", "address": "db.corp.example", "ports": [{"port": 5432}]}]}})
    world.kube.add(TAILNET_EGRESS, {"metadata": {"name": "other", "namespace": "elsewhere"}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:egress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "x", "address": "198.18.9.9", "ports": [{"port": 1}]}]}})
    world.add_gateway(suspend=False)

    await world.reconcile_gateway()

    sts = world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
    assert sts is not None
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TS_ROUTES"].split(",") == ["10.96.0.53/32", "10.250.0.0/24", "192.168.10.0/24", "198.18.1.10/32"]


async def test_a_tag_the_policy_does_not_own_creates_nothing() -> None:
    world = await ready_world('{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    world.add_gateway(suspend=False)

    await world.reconcile_gateway()

    assert world.cond("Ready")["reason"] == "TagNotOwned" and "tag:gateway" in world.cond("Ready")["message"]
    assert world.headscale.preauth_keys == {} and world.snapshot() == {}


async def test_receipts_are_written_once_from_the_node_that_registered_with_the_key() -> None:
    world = await created_world()
    node = world.register()

    await world.reconcile_gateway()

    receipts = world.obj()["status"]["receipts"]
    assert receipts == {"nodeId": "41", "nodeKey": node["nodeKey"], "createdAt": "2026-01-01T00:00:05Z",
                        "stateSecret": "edge-gateway-state"}
    [key] = world.headscale.preauth_keys.values()
    assert key.get("expired"), "nothing else may register with the gateway's key"
    assert world.kube.get(SECRET, "edge-gateway-auth-key", GW_NS) is None
    assert world.cond("Registered")["status"] == "True"
    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("True", "Running")
    assert world.obj()["status"]["routes"]["advertised"] == sorted(node["availableRoutes"])
    assert "Registered" in world.events.reasons


async def test_a_node_of_someone_else_is_not_taken_for_the_gateway() -> None:
    world = await created_world()
    world.headscale.nodes.append({"id": "9", "name": "laptop", "tags": ["tag:gateway"], "nodeKey": "nodekey:ff",
                                  "preAuthKey": {"id": "999"}})

    await world.reconcile_gateway()

    assert "receipts" not in world.obj()["status"]
    assert world.cond("Registered")["reason"] == "Registering"


async def test_a_second_reconcile_creates_nothing_new() -> None:
    world = await registered_world()
    world.pod_from_template()
    await world.reconcile_gateway()
    before, keys, calls = world.snapshot(), dict(world.headscale.preauth_keys), len(world.headscale.calls)
    writes = len(world.kube.writes)

    await world.reconcile_gateway()
    await world.reconcile_gateway()

    assert world.snapshot() == before
    assert world.headscale.preauth_keys == keys
    assert not any(c.startswith("POST /api/v1/preauthkey") for c in world.headscale.calls[calls:])
    assert not [w for w in world.kube.writes[writes:] if w[0] == "delete"]
    assert world.obj()["status"]["receipts"]["nodeId"] == "41"


async def test_the_dns_host_route_is_approved_on_the_gateways_own_node() -> None:
    world = await registered_world()

    await world.reconcile_gateway()

    [node] = world.headscale.nodes
    assert f"{DNS_IP}/32" in node["approvedRoutes"]
    assert world.cond("RoutesApproved")["status"] == "True"
    split = world.cond("SplitDNS")
    assert split["reason"] == "HeadscaleConfigRequired"
    assert "corp.example:\n        - 10.96.0.53" in split["message"]


# -- fresh-only -----------------------------------------------------------------------------------


async def test_a_state_secret_that_exists_without_receipts_is_not_adopted() -> None:
    world = await ready_world()
    world.dns_service_gets_address()
    world.kube.add(SECRET, {"metadata": {"name": "edge-gateway-state", "namespace": GW_NS},
                            "data": {"_machinekey": "bW9yZQ=="}})
    world.add_gateway(suspend=False)

    await world.reconcile_gateway()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "StateSecretExists")
    assert "not adopted" in ready["message"] and "delete the Secret" in ready["message"]
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS) is None
    assert world.kube.get(SECRET, "edge-gateway-state", GW_NS)["data"] == {"_machinekey": "bW9yZQ=="}  # type: ignore[index]


async def test_a_state_secret_of_an_earlier_object_with_the_same_name_is_not_adopted() -> None:
    world = await created_world()
    state = world.kube.get(SECRET, "edge-gateway-state", GW_NS)
    assert state is not None
    world.kube.update(SECRET, {**state, "metadata": {**state["metadata"], "annotations": {
        "tailnet.dev/gateway-uid": "an-earlier-uid"}}})

    await world.reconcile_gateway()

    assert world.cond("Ready")["reason"] == "StateSecretExists"


async def test_receipts_whose_node_is_gone_are_reported_and_nothing_is_recreated() -> None:
    world = await registered_world()
    before, keys = world.snapshot(), dict(world.headscale.preauth_keys)
    world.headscale.nodes.clear()

    await world.reconcile_gateway()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NodeGone")
    assert "41" in ready["message"] and "deletionPolicy: Delete" in ready["message"]
    assert world.snapshot() == before and world.headscale.preauth_keys == keys
    assert world.obj()["status"]["receipts"]["nodeId"] == "41"


async def test_a_gone_state_secret_is_reported_not_recreated() -> None:
    world = await registered_world()
    await world.kube.delete(SECRET, "edge-gateway-state", GW_NS)

    await world.reconcile_gateway()

    assert world.cond("Ready")["reason"] == "StateSecretGone"
    assert world.kube.get(SECRET, "edge-gateway-state", GW_NS) is None


# -- following ------------------------------------------------------------------------------------


async def test_the_image_a_gateway_names_is_ignored_and_the_gateway_says_so() -> None:
    world = await registered_world()
    world.pod_from_template()
    await world.reconcile_gateway()
    before = world.snapshot()
    assert world.cond("ImageIgnored") == {}

    world.edit_spec(image="attacker.example/root-shell:latest")
    await world.reconcile_gateway()

    assert world.snapshot() == before, "the template, and so the pod, stays as it is"
    ignored = world.cond("ImageIgnored")
    assert (ignored["status"], ignored["reason"]) == ("True", "Deprecated")
    assert "attacker.example/root-shell:latest" in ignored["message"] and IMAGE in ignored["message"]
    assert world.cond("RestartPending")["reason"] == "UpToDate"

    world.edit_spec(image=None)
    await world.reconcile_gateway()
    assert world.cond("ImageIgnored") == {}


async def test_the_operators_image_reaches_the_template_and_says_a_restart_is_pending() -> None:
    world = await registered_world()
    world.pod_from_template()
    await world.reconcile_gateway()
    assert world.cond("RestartPending")["reason"] == "UpToDate"
    pod_version = world.kube.get(POD, "edge-gateway-0", GW_NS)["metadata"]["resourceVersion"]  # type: ignore[index]

    world.gateway = world.reconciler("registry.example/tailscale:v1.98.11")  # the operator upgraded
    await world.reconcile_gateway()

    sts = world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
    assert sts is not None and sts["spec"]["template"]["spec"]["containers"][0]["image"].endswith("v1.98.11")
    pending = world.cond("RestartPending")
    assert (pending["status"], pending["reason"]) == ("True", "TemplateChanged")
    assert "kubectl delete pod -n tailnet-gateway edge-gateway-0" in pending["message"]
    pod = world.kube.get(POD, "edge-gateway-0", GW_NS)
    assert pod is not None and pod["metadata"]["resourceVersion"] == pod_version, "the operator never touches the pod"
    assert world.obj()["status"]["receipts"]["nodeId"] == "41"


async def test_a_new_site_route_reaches_the_template_and_is_not_advertised_until_the_restart() -> None:
    world = await registered_world()

    world.edit_spec(siteRoutes=["192.168.10.0/24", "192.168.20.0/24"])
    await world.reconcile_gateway()

    sts = world.kube.get(STATEFUL_SET, "edge-gateway", GW_NS)
    assert sts is not None
    assert "192.168.20.0/24" in str(sts["spec"]["template"]["spec"]["containers"][0]["env"])
    routes = world.cond("RoutesApproved")
    assert (routes["status"], routes["reason"]) == ("False", "NotAdvertised") and "192.168.20.0/24" in routes["message"]


async def test_a_route_waiting_for_approval_is_looked_at_again_soon_and_then_at_the_resync() -> None:
    world = await created_world()
    node = world.register()
    node["approvedRoutes"] = []  # the site route waits for the Policy reconciler's approval
    world.pod_from_template()

    waiting = await world.reconcile_gateway()
    assert world.cond("RoutesApproved")["reason"] == "NotApproved"
    assert waiting.requeue_after == SETTLING_SECONDS

    node["approvedRoutes"] = list(node["availableRoutes"])
    settled = await world.reconcile_gateway()
    assert world.cond("RoutesApproved")["status"] == "True"
    assert settled.requeue_after == RESYNC_SECONDS


async def test_a_route_waiting_for_a_restart_does_not_poll() -> None:
    world = await registered_world()
    world.pod_from_template()
    world.edit_spec(siteRoutes=["192.168.10.0/24", "192.168.20.0/24"])

    result = await world.reconcile_gateway()

    assert world.cond("RestartPending")["status"] == "True"
    assert result.requeue_after == RESYNC_SECONDS


async def test_the_hosts_file_follows_into_the_zone() -> None:
    world = await registered_world()
    hosts = world.kube.get(CONFIG_MAP, "tailnet-hosts", "kube-system")
    assert hosts is not None
    world.kube.update(CONFIG_MAP, {**hosts, "data": {"hosts": HOSTS + "10.96.8.8 api.corp.example\n"}})

    await world.reconcile_gateway()

    zone = world.kube.get(CONFIG_MAP, "edge-gateway", GW_NS)
    assert zone is not None and "api.corp.example. 30 IN A 10.96.8.8" in zone["data"]["zone.db"]


async def test_suspending_after_creation_keeps_everything() -> None:
    world = await registered_world()
    before = world.snapshot()

    world.edit_spec(suspend=True, siteRoutes=["192.168.10.0/24", "192.168.20.0/24"])
    await world.reconcile_gateway()

    assert world.snapshot() == before
    assert "keeps running" in world.cond("Ready")["message"]
    assert world.obj()["status"]["receipts"]["nodeId"] == "41"


# -- deletion -------------------------------------------------------------------------------------


async def test_delete_removes_the_pod_the_secrets_the_objects_and_the_node() -> None:
    world = await registered_world()
    world.pod_from_template()
    world.edit_spec(deletionPolicy="Delete")
    await world.kube.delete(TAILNET_GATEWAY, "edge")

    await world.reconcile_gateway()

    assert world.snapshot() == {}
    assert world.headscale.nodes == []
    assert world.kube.get(TAILNET_GATEWAY, "edge") is None
    assert world.events.reasons[-1] == "Deleted"


async def test_delete_before_registration_expires_the_unused_key() -> None:
    world = await created_world()
    world.edit_spec(deletionPolicy="Delete")
    await world.kube.delete(TAILNET_GATEWAY, "edge")

    await world.reconcile_gateway()

    [key] = world.headscale.preauth_keys.values()
    assert key.get("expired")
    assert world.snapshot() == {}


async def test_delete_retries_an_unreachable_headscale_then_lets_go_with_a_warning() -> None:
    world = await registered_world()
    world.edit_spec(deletionPolicy="Delete")
    await world.kube.delete(TAILNET_GATEWAY, "edge")
    world.headscale.down = "connect"

    result = await world.reconcile_gateway()
    assert result.requeue_after and world.kube.get(TAILNET_GATEWAY, "edge") is not None

    world.clock.advance(6 * 60)
    await world.reconcile_gateway()
    assert world.kube.get(TAILNET_GATEWAY, "edge") is None
    assert "NodeNotDeleted" in world.events.reasons


async def test_retain_leaves_the_pod_the_state_secret_and_the_node_and_says_so() -> None:
    world = await registered_world()
    world.pod_from_template()
    before = world.snapshot()
    await world.kube.delete(TAILNET_GATEWAY, "edge")

    await world.reconcile_gateway()

    assert world.kube.get(TAILNET_GATEWAY, "edge") is None
    assert world.snapshot() == before
    assert [n["id"] for n in world.headscale.nodes] == ["41"]
    assert world.events.reasons[-1] == "Retained"


async def test_a_suspended_gateway_that_never_created_anything_goes_at_once() -> None:
    world = await ready_world()
    world.add_gateway()
    await world.reconcile_gateway()
    await world.kube.delete(TAILNET_GATEWAY, "edge")

    assert world.kube.get(TAILNET_GATEWAY, "edge") is None


# -- the other branches ---------------------------------------------------------------------------


async def test_a_missing_tailnet_and_a_tailnet_without_a_working_key_create_nothing() -> None:
    world = GatewayWorld()
    world.add_gateway(suspend=False, tailnetRef={"name": "nope"})
    await world.reconcile_gateway()
    assert world.cond("Ready")["reason"] == "TailnetNotFound"

    world.bootstrap_secret()
    world.add_tailnet()  # not reconciled: no working key yet
    world.edit_spec(tailnetRef={"name": "tn"})
    await world.reconcile_gateway()
    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("Unknown", "WaitingForAccess")
    assert world.snapshot() == {} and world.headscale.preauth_keys == {}


async def test_an_unreachable_headscale_is_reported_and_retried() -> None:
    world = await ready_world()
    world.add_gateway(suspend=False)
    world.headscale.down = "connect"

    result = await world.reconcile_gateway()

    assert world.cond("Ready")["reason"] == "HeadscaleUnavailable" and result.requeue_after
    assert world.snapshot() == {}


async def test_an_offline_router_is_not_ready_and_keeps_its_receipts() -> None:
    world = await created_world()
    world.register(online=False)

    await world.reconcile_gateway()

    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("False", "NodeOffline")
    assert world.cond("Registered")["status"] == "True"
    assert world.obj()["status"]["receipts"]["nodeId"] == "41"


async def test_a_node_registered_with_the_key_a_rotation_replaced_still_counts() -> None:
    world = await created_world()
    [old] = world.headscale.preauth_keys.values()
    world.clock.advance(13 * 3600)  # past half the key's lifetime: a new key, the old one expired
    await world.reconcile_gateway()
    assert len(world.headscale.preauth_keys) == 2
    world.register(key_id=old["id"])  # the pod started with the old key just before
    state = world.kube.get(SECRET, "edge-gateway-state", GW_NS)
    assert state is not None and len(state["metadata"]["annotations"]["tailnet.dev/pre-auth-key-ids"].split(",")) == 2

    await world.reconcile_gateway()

    assert world.obj()["status"]["receipts"]["nodeId"] == "41"
