"""The Ingress reconciler on the fake client and a fake Headscale: tag pre-check, pre-auth key,
owned objects in the tenant namespace, cert-manager Certificates (and their absence), status from
the agent's /status, the node from Headscale, and deletion."""

from __future__ import annotations

import base64
import copy
import json
from datetime import timedelta
from typing import Any

from tailnet_operator.controllers.ingress import IngressSettings, ingress_reconciler
from tailnet_operator.controllers.kinds import TAILNET, TAILNET_EGRESS, TAILNET_INGRESS
from tailnet_operator.headscale import OWNER_TAG, installation_tag
from tailnet_operator.names import FINALIZER
from tailnet_operator.runtime import (
    CONFIG_MAP,
    SECRET,
    SERVICE,
    Applier,
    Request,
    Resource,
    Result,
)
from tailnet_operator.runtime.errors import Forbidden, NotFound
from tailnet_operator.runtime.kinds import CERTIFICATE, DEPLOYMENT, NETWORK_POLICY
from tailnet_operator.types import JSON

from .harness import URL as URL_OF_WORLD
from .harness import World

IMAGE = "localhost/tailnet-operator:test"
TENANT = "tenant"
OWNING = '{"tagOwners": {"tag:ingress-shop": []}, "grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}'
DNS = {"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"}, "zones": ["apps.example.internal"]}
TCP = {"name": "db", "port": 5432, "backend": {"service": "postgres", "port": 5432}}
WEB = {"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 8080},
       "hosts": [{"name": "shop.apps.example.internal", "alias": "shop", "tls": {"secretName": "shop-tls"}}]}
CM_HOST = {"name": "admin.apps.example.internal",
           "tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}}}
CM_SECRET = "shop-admin.apps.example.internal-tls"
TENANCY = [{"namespaces": [TENANT], "tags": ["tag:ingress-*"], "dnsNames": ["*.apps.example.internal"]}]


class FakeAgent:
    """The agent's /status as a test sets it (None: unreadable)."""

    def __init__(self) -> None:
        self.doc: JSON | None = None

    async def read(self, owner: Any) -> JSON | None:
        return self.doc


class Writes(Applier):
    """The Applier, with the refusals a cluster without cert-manager (or without RBAC) gives."""

    refuse: dict[Resource, Exception]

    async def apply(self, resource: Resource, body: JSON, **kwargs: Any) -> JSON:
        if resource in self.refuse:
            raise self.refuse[resource]
        return await super().apply(resource, body, **kwargs)


class IngressWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.agent = FakeAgent()
        self.writer = Writes(self.kube, self.kube, field_manager="tailnet-operator-ingress")
        self.writer.refuse = {}
        self.ingress = ingress_reconciler(
            self.deps, self.writer,
            IngressSettings(agent_image=IMAGE, operator_namespace="tailnet-system", operator_labels={"app": "op"}),
            agent_status=self.agent)

    async def reconcile_ingress(self, name: str = "shop") -> Result:
        return await self.ingress.reconcile(Request(TENANT, name))

    def add_ingress(self, name: str = "shop", **spec: Any) -> JSON:
        body = {"tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop", "hostname": "shop-gw",
                "exposes": [TCP], **spec}
        return self.kube.add(TAILNET_INGRESS, {"metadata": {"name": name, "namespace": TENANT}, "spec": body})

    def obj(self, name: str = "shop") -> JSON:
        found = self.kube.get(TAILNET_INGRESS, name, TENANT)
        assert found is not None
        return found

    def cond(self, type_: str) -> JSON:
        return next((c for c in self.obj().get("status", {}).get("conditions") or [] if c["type"] == type_), {})

    def stored_key(self) -> str:
        secret = self.kube.get(SECRET, "shop-ingress-auth-key", TENANT)
        assert secret is not None
        return base64.b64decode(secret["data"]["authKey"]).decode()

    def tls_secret(self, name: str, **data: str) -> None:
        self.kube.add(SECRET, {"metadata": {"name": name, "namespace": TENANT}, "type": "kubernetes.io/tls",
                               "data": {k.replace("_", "."): base64.b64encode(v.encode()).decode()
                                        for k, v in (data or {"tls_crt": "c", "tls_key": "k"}).items()}})

    def edit_spec(self, **spec: Any) -> None:
        obj = copy.deepcopy(self.obj())
        obj["spec"].update(spec)
        obj["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
        self.kube.update(TAILNET_INGRESS, obj)


async def world_with_tailnet(policy: str = OWNING, **tailnet: Any) -> IngressWorld:
    world = IngressWorld()
    world.bootstrap_secret()
    world.add_tailnet(**{"tenants": TENANCY, **tailnet})
    await world.reconcile_tailnet()
    world.headscale.policy = policy
    return world


def registered(node_id: str, key_id: str, *, name: str = "shop-gw") -> JSON:
    """A Headscale node made with the pre-auth key ``key_id``, addressed like :func:`agent_doc`'s."""
    return {"id": node_id, "name": name, "givenName": name, "online": True, "tags": ["tag:ingress-shop"],
            "ipAddresses": [f"fd7a:115c:a1e0::{node_id}", f"100.64.0.{node_id}"], "preAuthKey": {"id": key_id}}


def agent_doc(*, listening: bool = True, reachable: bool | None = True, host_error: str | None = None) -> JSON:
    return {"node": {"id": "9", "name": "shop-gw.tailnet.test", "addresses": ["fd7a:115c:a1e0::9", "100.64.0.9"]},
            "exposes": [
                {"name": "db", "port": 5432, "mode": "tcp", "listening": listening,
                 "message": None if listening else "address in use", "reachable": reachable,
                 "backendError": None if reachable is not False else "refused", "hosts": []},
                {"name": "web", "port": 443, "mode": "http", "listening": True, "reachable": True, "hosts": [
                    {"name": "shop.apps.example.internal", "alias": "shop", "notAfter": "2027-01-01T00:00:00Z",
                     "error": host_error}]}],
            "exposesFile": {"error": None, "loadedAt": "2026-01-01T00:00:00Z"}}


async def test_a_tag_the_policy_does_not_own_creates_nothing_and_gives_a_snippet() -> None:
    world = await world_with_tailnet('{"grants": [{"src": ["*"], "dst": ["*"], "ip": ["*"]}]}')
    world.add_ingress()

    await world.reconcile_ingress()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "TagNotOwned")
    assert '"tag:ingress-shop"' in ready["message"] and "tagOwners" in ready["message"]
    assert world.cond("TagOwned")["reason"] == "TagNotOwned"
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT) is None
    assert world.kube.get(SECRET, "shop-ingress-auth-key", TENANT) is None


async def test_an_owned_tag_gets_a_key_and_the_agent_objects_in_the_tenant_namespace() -> None:
    world = await world_with_tailnet()
    world.add_ingress(exposes=[TCP, WEB])

    result = await world.reconcile_ingress()

    [key] = world.headscale.preauth_keys.values()
    marker = installation_tag(world.tailnet_obj()["metadata"]["uid"])
    assert key["reusable"] and key["ephemeral"] and key["aclTags"] == ["tag:ingress-shop", marker]
    assert world.stored_key() == key["key"]
    obj = world.obj()
    assert FINALIZER in obj["metadata"]["finalizers"]
    for resource, name in ((DEPLOYMENT, "shop-ingress-agent"), (SERVICE, "shop-ingress-agent"),
                           (NETWORK_POLICY, "shop-ingress-agent"), (CONFIG_MAP, "shop-ingress-config"),
                           (SECRET, "shop-ingress-auth-key")):
        found = world.kube.get(resource, name, TENANT)
        assert found is not None, (resource, name)
        assert found["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    deployment = world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT)
    assert deployment is not None
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AGENT_MODE"] == "ingress"
    assert obj["status"]["preAuthKey"]["id"] == key["id"] and key["key"] not in str(obj["status"])
    assert world.cond("TagOwned")["status"] == world.cond("PreAuthKeyValid")["status"] == "True"
    assert (world.cond("CertificatesReady")["status"], world.cond("CertificatesReady")["reason"]) == \
        ("False", "SecretMissing")
    assert "shop-tls" in world.cond("CertificatesReady")["message"]
    assert (world.cond("ExposesReady")["status"], world.cond("ExposesReady")["reason"]) == \
        ("Unknown", "AgentStatusUnknown")
    assert world.cond("Ready")["reason"] == "SecretMissing"
    assert world.events.reasons[-1] == "PreAuthKeyRotated"
    assert result.requeue_after == 30.0


async def test_with_the_agent_listening_and_the_secret_present_the_ingress_is_ready() -> None:
    world = await world_with_tailnet(dns=DNS)
    world.add_ingress(exposes=[TCP, WEB], dnsTemplate="{hostname}.apps.example.internal")
    world.tls_secret("shop-tls")
    world.agent.doc = agent_doc()
    await world.reconcile_ingress()
    world.headscale.nodes = [registered("9", next(iter(world.headscale.preauth_keys)))]

    await world.reconcile_ingress()

    status = world.obj()["status"]
    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("True", "Ready")
    assert world.cond("CertificatesReady")["reason"] == "Present"
    assert world.cond("ExposesReady")["reason"] == "Listening"
    assert status["node"] == {"id": "9", "name": "shop-gw.tailnet.test",
                              "addresses": ["fd7a:115c:a1e0::9", "100.64.0.9"]}
    assert status["magicDNSName"] == "shop-gw.tailnet.test"
    assert status["dnsNames"] == ["shop-gw.apps.example.internal", "shop.apps.example.internal"]
    db, web = status["exposes"]
    assert db == {"name": "db", "ready": True, "listening": True, "backendReachable": True,
                  "message": "listening on 5432; postgres.tenant.svc:5432 answers"}
    assert web["hosts"] == [{"name": "shop.apps.example.internal", "alias": "shop",
                             "aliasNames": ["shop.apps.example.internal"], "secretName": "shop-tls",
                             "certificateNotAfter": "2027-01-01T00:00:00Z"}]


async def test_each_agent_problem_has_its_reason() -> None:
    world = await world_with_tailnet()
    world.add_ingress(exposes=[TCP, WEB])
    world.tls_secret("shop-tls")
    cases = [(agent_doc(listening=False), "False", "NotListening", "address in use"),
             (agent_doc(reachable=False), "False", "BackendUnreachable", "refused"),
             (agent_doc(host_error="no such file"), "False", "CertificateError", "no such file"),
             (agent_doc(reachable=None), "True", "Listening", "not been probed"),
             ({"node": {"id": "9", "name": "x", "addresses": []}, "exposes": []}, "Unknown",
              "AgentStatusUnknown", "does not list")]
    for doc, status, reason, words in cases:
        world.agent.doc = doc
        await world.reconcile_ingress()
        cond = world.cond("ExposesReady")
        assert (cond["status"], cond["reason"]) == (status, reason), doc
        assert words in cond["message"] + world.obj()["status"]["exposes"][0]["message"]
        assert world.cond("Ready")["status"] == status
    world.agent.doc = agent_doc(reachable=False)
    await world.reconcile_ingress()
    db = world.obj()["status"]["exposes"][0]
    assert (db["ready"], db["reason"], db["backendReachable"]) == (False, "BackendUnreachable", False)


async def test_a_tls_secret_without_a_certificate_is_named() -> None:
    world = await world_with_tailnet()
    world.add_ingress(exposes=[WEB])
    world.tls_secret("shop-tls", ca_crt="x")

    await world.reconcile_ingress()

    cond = world.cond("CertificatesReady")
    assert (cond["status"], cond["reason"]) == ("False", "SecretInvalid") and "tls.crt" in cond["message"]


async def test_a_cert_manager_host_gets_a_certificate_and_waits_for_its_secret() -> None:
    world = await world_with_tailnet(dns=DNS)
    web = {**WEB, "hosts": [{**CM_HOST, "alias": "admin"}]}
    world.add_ingress(exposes=[web])

    await world.reconcile_ingress()

    cert = world.kube.get(CERTIFICATE, "shop-admin.apps.example.internal", TENANT)
    assert cert is not None
    assert cert["spec"]["dnsNames"] == ["admin.apps.example.internal"]
    assert cert["spec"]["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    assert cert["spec"]["secretName"] == CM_SECRET
    assert cert["metadata"]["ownerReferences"][0]["uid"] == world.obj()["metadata"]["uid"]
    cond = world.cond("CertificatesReady")
    assert (cond["status"], cond["reason"]) == ("False", "CertificatePending") and CM_SECRET in cond["message"]
    deployment = world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT)
    assert deployment is not None
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert CM_SECRET in str(next(v for v in volumes if v["name"] == "certs"))

    world.tls_secret(CM_SECRET)
    await world.reconcile_ingress()
    assert world.cond("CertificatesReady")["reason"] == "Present"


async def test_without_cert_manager_a_host_asking_for_it_says_so_and_the_rest_is_created() -> None:
    world = await world_with_tailnet()
    world.writer.refuse[CERTIFICATE] = NotFound(404, "NotFound", "the server could not find the requested resource")
    world.add_ingress(exposes=[TCP, {**WEB, "hosts": [CM_HOST]}])

    await world.reconcile_ingress()

    cond = world.cond("CertificatesReady")
    assert (cond["status"], cond["reason"]) == ("False", "CertManagerNotInstalled")
    assert "install cert-manager" in cond["message"] and "tls.secretName" in cond["message"]
    assert "admin.apps.example.internal" in cond["message"]
    assert world.cond("Ready")["reason"] == "CertManagerNotInstalled"
    assert world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT) is not None

    world.writer.refuse[CERTIFICATE] = Forbidden(403, "Forbidden", "certificates is forbidden")
    await world.reconcile_ingress()
    cond = world.cond("CertificatesReady")
    assert cond["reason"] == "CertificateNotCreated" and "forbidden" in cond["message"]


async def test_without_the_agent_the_node_comes_from_the_key_it_registered_with() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    key_id = next(iter(world.headscale.preauth_keys))
    world.headscale.nodes = [
        {"id": "3", "name": "laptop", "givenName": "laptop", "ipAddresses": ["100.64.0.3"], "online": True},
        {"id": "7", "name": "shop-gw", "givenName": "shop-gw", "ipAddresses": ["100.64.0.7", "fd7a:115c:a1e0::7"],
         "online": True, "tags": ["tag:ingress-shop"], "preAuthKey": {"id": key_id}}]

    await world.reconcile_ingress()

    status = world.obj()["status"]
    assert status["node"] == {"id": "7", "name": "shop-gw", "addresses": ["100.64.0.7", "fd7a:115c:a1e0::7"]}
    assert "magicDNSName" not in status, "only the agent knows the MagicDNS name"


async def test_changing_exposes_changes_the_config_map_but_not_the_pod_template() -> None:
    world = await world_with_tailnet()
    world.add_ingress(exposes=[TCP, WEB])
    await world.reconcile_ingress()
    deployment = world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT)
    assert deployment is not None
    template = copy.deepcopy(deployment["spec"]["template"])

    world.edit_spec(exposes=[{**TCP, "port": 6543}, WEB])
    await world.reconcile_ingress()

    after = world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT)
    assert after is not None and after["spec"]["template"] == template
    config = world.kube.get(CONFIG_MAP, "shop-ingress-config", TENANT)
    assert config is not None and '"port": 6543' in config["data"]["exposes.json"]


async def test_a_steady_ingress_writes_nothing() -> None:
    world = await world_with_tailnet()
    hosts: list[Any] = [*WEB["hosts"], CM_HOST]  # type: ignore[misc]
    world.add_ingress(exposes=[TCP, {**WEB, "hosts": hosts}])
    world.agent.doc = agent_doc()
    await world.reconcile_ingress()
    await world.reconcile_ingress()
    writes = list(world.kube.writes)

    world.clock.advance(30)
    await world.reconcile_ingress()

    assert world.kube.writes == writes


async def test_http_exposes_sharing_a_port_are_served_and_a_shared_name_is_refused() -> None:
    world = await world_with_tailnet()
    other = {**WEB, "name": "api", "backend": {"service": "api", "port": 50051, "protocol": "h2"},
             "hosts": [{"name": "api.apps.example.internal", "alias": "api", "tls": {"secretName": "a"}}]}
    world.add_ingress(exposes=[WEB, other])

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] != "HostNameClash"
    config = world.kube.get(CONFIG_MAP, "shop-ingress-config", TENANT)
    assert config is not None
    exposes = json.loads(config["data"]["exposes.json"])
    assert [(e["name"], e["port"]) for e in exposes] == [("web", WEB["port"]), ("api", WEB["port"])]
    assert exposes[1]["backend"]["protocol"] == "h2" and "protocol" not in exposes[0]["backend"]


async def test_a_name_shared_by_two_hosts_on_one_port_is_refused_with_the_reason() -> None:
    world = await world_with_tailnet()
    clash = {**WEB, "name": "api", "hosts": [{"name": "api.apps.example.internal", "alias": "shop",
                                              "tls": {"secretName": "a"}}]}
    world.add_ingress(exposes=[WEB, clash])
    await world.reconcile_ingress()
    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "HostNameClash"), ready
    assert "expose web" in ready["message"] and "expose api" in ready["message"]
    assert world.headscale.preauth_keys == {}


async def test_a_missing_tailnet_or_working_key_or_headscale_is_reported() -> None:
    world = IngressWorld()
    world.add_ingress()
    await world.reconcile_ingress()
    assert world.cond("Ready")["reason"] == "TailnetNotFound"

    world.add_tailnet(tenants=TENANCY)
    result = await world.reconcile_ingress()
    assert (world.cond("Ready")["status"], world.cond("Ready")["reason"]) == ("Unknown", "WaitingForAccess")
    assert result.requeue_after == 10.0

    world.bootstrap_secret()
    await world.reconcile_tailnet()
    world.headscale.policy = OWNING
    world.headscale.refuse["GET /api/v1/node"] = (503, 14, "unavailable")
    await world.reconcile_ingress()
    assert world.cond("Ready")["reason"] == "HeadscaleUnavailable"


async def test_deleting_the_ingress_expires_its_key_and_releases_the_finalizer() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    key = world.stored_key()

    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)
    await world.reconcile_ingress()

    assert not world.headscale.preauth_live(key)
    assert world.kube.get(TAILNET_INGRESS, "shop", TENANT) is None
    assert "PreAuthKeyExpired" in world.events.reasons
    assert world.kube.get(SECRET, "ingress.tenant.shop", "tailnet-system") is None, "the record outlived it"


async def test_a_key_that_cannot_be_expired_is_retried_then_left_with_a_warning() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    world.headscale.refuse["POST /api/v1/preauthkey/expire"] = (503, 14, "unavailable")
    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)

    result = await world.reconcile_ingress()
    assert result.requeue_after == 10.0 and world.kube.get(TAILNET_INGRESS, "shop", TENANT) is not None

    world.clock.advance(timedelta(minutes=5, seconds=1).total_seconds())
    await world.reconcile_ingress()
    assert world.kube.get(TAILNET_INGRESS, "shop", TENANT) is None
    assert world.events.reasons[-1] == "PreAuthKeyNotExpired"


async def test_a_namespace_that_has_not_let_the_operator_in_gets_the_command_and_no_key() -> None:
    world = await world_with_tailnet()
    world.writer.refuse[CONFIG_MAP] = Forbidden(403, "Forbidden", 'configmaps is forbidden: cannot patch in "tenant"')
    world.add_ingress()

    result = await world.reconcile_ingress()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NamespaceNotGranted")
    assert ("kubectl -n tenant create rolebinding tailnet-operator --clusterrole=tailnet-operator-tenant "
            "--serviceaccount=tailnet-system:tailnet-operator") in ready["message"]
    assert world.headscale.preauth_keys == {}, "no key that could not be stored"
    assert result.requeue_after == 30.0

    del world.writer.refuse[CONFIG_MAP]
    await world.reconcile_ingress()
    assert world.kube.get(DEPLOYMENT, "shop-ingress-agent", TENANT) is not None


# -- the trust boundary: what a tenant's namespace may use, and what its pods may say --------------


async def test_an_ingress_in_a_namespace_the_tailnet_does_not_name_gets_no_key_and_nothing_is_written() -> None:
    world = await world_with_tailnet(tenants=[{"namespaces": ["elsewhere"], "tags": ["tag:ingress-*"]}])
    world.add_ingress()
    writes = len(world.kube.writes)

    await world.reconcile_ingress()

    ready = world.cond("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "NamespaceNotTenant")
    assert f"namespace {TENANT} is not a tenant of the Tailnet tn" in ready["message"]
    assert world.headscale.preauth_keys == {}
    assert world.kube.get(SECRET, "shop-ingress-auth-key", TENANT) is None
    assert {w[1] for w in world.kube.writes[writes:]} == {"TailnetIngress"}, "only its finalizer and status"
    assert world.events.reasons[-1] == "NamespaceNotTenant"


async def test_an_egress_tag_is_not_the_tenants_even_under_its_prefix() -> None:
    world = await world_with_tailnet(OWNING.replace("tag:ingress-shop", "tag:ingress-db"))
    world.kube.add(TAILNET_EGRESS, {"metadata": {"name": "db", "namespace": "tailnet-system"}, "spec": {
        "tailnetRef": {"name": "tn"}, "tag": "tag:ingress-db", "consumerNamespaces": ["apps"],
        "targets": [{"name": "db", "address": "198.18.1.10", "ports": [{"port": 5432}]}]}})
    world.add_ingress(tag="tag:ingress-db")

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] == "TagReserved"
    assert world.headscale.preauth_keys == {}


async def test_a_grant_source_of_the_live_policy_is_not_the_tenants_under_its_prefix() -> None:
    policy = ('{"tagOwners": {"tag:ingress-shop": [], "tag:ingress-ci": []}, '
              '"grants": [{"src": ["tag:ingress-ci"], "dst": ["*"], "ip": ["*"]}]}')
    world = await world_with_tailnet(policy)
    world.add_ingress(tag="tag:ingress-ci")

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] == "TagReserved"
    assert world.headscale.preauth_keys == {}


async def test_a_name_outside_the_zones_is_refused_before_a_key_is_made() -> None:
    world = await world_with_tailnet(dns=DNS)
    world.add_ingress(dnsTemplate="kubernetes.default.svc.cluster.local")

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] == "DNSNameOutsideZones"
    assert world.headscale.preauth_keys == {}


def ready_of(world: IngressWorld, name: str) -> JSON:
    obj = world.kube.get(TAILNET_INGRESS, name, TENANT) or {}
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


async def test_a_name_another_ingress_holds_is_refused_on_the_later_one_in_any_order() -> None:
    world = await world_with_tailnet(dns=DNS)
    for name, created in (("late", "2026-02-01T00:00:00Z"), ("early", "2026-01-01T00:00:00Z")):
        world.kube.add(TAILNET_INGRESS, {"metadata": {"name": name, "namespace": TENANT, "creationTimestamp": created},
                                         "spec": {"tailnetRef": {"name": "tn"}, "tag": "tag:ingress-shop",
                                                  "hostname": name, "exposes": [TCP],
                                                  "dnsTemplate": "web.apps.example.internal"}})

    await world.reconcile_ingress("late")
    await world.reconcile_ingress("early")

    late = ready_of(world, "late")
    assert late["reason"] == "DNSNameTaken" and f"TailnetIngress {TENANT}/early" in late["message"]
    early = ready_of(world, "early")
    assert early["reason"] != "DNSNameTaken"
    assert len(world.headscale.preauth_keys) == 1


async def test_the_node_and_its_address_come_from_headscale_never_from_the_pods_status() -> None:
    world = await world_with_tailnet(dns=DNS)
    world.add_ingress(dnsTemplate="{hostname}.apps.example.internal")
    spoofed = agent_doc()
    spoofed["node"] = {"id": "66", "name": "shop-gw.tailnet.test", "addresses": ["10.96.0.1"]}
    world.agent.doc = spoofed
    await world.reconcile_ingress()
    key_id = next(iter(world.headscale.preauth_keys))
    assert "node" not in world.obj()["status"], "no node registered with the key yet"

    world.headscale.nodes = [registered("7", key_id)]
    await world.reconcile_ingress()

    status = world.obj()["status"]
    assert status["node"] == {"id": "7", "name": "shop-gw", "addresses": ["fd7a:115c:a1e0::7", "100.64.0.7"]}
    record = world.kube.get(SECRET, "ingress.tenant.shop", "tailnet-system")
    assert record is not None
    assert record["metadata"]["annotations"]["tailnet.dev/node-address"] == "fd7a:115c:a1e0::7,100.64.0.7"


async def test_the_key_bookkeeping_lives_where_the_tenant_cannot_write() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()

    mounted = world.kube.get(SECRET, "shop-ingress-auth-key", TENANT)
    assert mounted is not None and not (mounted["metadata"].get("annotations") or {})
    record = world.kube.get(SECRET, "ingress.tenant.shop", "tailnet-system")
    assert record is not None
    assert record["metadata"]["annotations"]["tailnet.dev/key-id"] in world.headscale.preauth_keys
    assert base64.b64decode(record["data"]["authKey"]) == base64.b64decode(mounted["data"]["authKey"])


async def test_a_key_id_written_into_the_tenants_secret_expires_nobody_elses_key() -> None:
    world = await world_with_tailnet()
    async with world.headscale.factory(URL_OF_WORLD, world.working_key(), None) as hs:
        other = await hs.create_preauth_key(acl_tags=["tag:egress-db", OWNER_TAG], reusable=True, ephemeral=True)
    world.add_ingress()
    await world.reconcile_ingress()
    mounted = world.kube.get(SECRET, "shop-ingress-auth-key", TENANT)
    assert mounted is not None
    mounted["metadata"]["annotations"] = {"tailnet.dev/key-id": other.id, "tailnet.dev/previous-key-id": other.id}
    world.kube.update(SECRET, mounted)

    await world.kube.delete(TAILNET_INGRESS, "shop", TENANT)
    await world.reconcile_ingress()

    assert world.headscale.preauth_live(other.key), "the egress's key was expired through the tenant's Secret"
    assert world.kube.get(TAILNET_INGRESS, "shop", TENANT) is None


def withdraw_tenancy(world: IngressWorld) -> None:
    """The Tailnet admits the ingress's namespace no more."""
    tailnet = world.tailnet_obj()
    tailnet["spec"]["tenants"] = [{"namespaces": ["elsewhere"], "tags": ["tag:ingress-*"]}]
    tailnet["metadata"]["generation"] = 2
    world.kube.update(TAILNET, tailnet)


async def test_an_ingress_whose_tenancy_is_withdrawn_loses_its_key_node_and_record() -> None:
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    key_id = next(iter(world.headscale.preauth_keys))
    world.headscale.nodes = [registered("7", key_id)]
    withdraw_tenancy(world)

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] == "NamespaceNotTenant"
    assert world.headscale.preauth_keys[key_id].get("expired")
    assert world.headscale.nodes == []
    assert world.kube.get(SECRET, "ingress.tenant.shop", "tailnet-system") is None


async def test_a_withdrawn_ingress_loses_the_node_its_agent_registered_before_key_rotations() -> None:
    """An agent pod outlives its key: it registered with the key of two rotations ago and is still
    online. Withdrawing the namespace's tenancy must remove that node from the tailnet too."""
    world = await world_with_tailnet()
    world.add_ingress()
    await world.reconcile_ingress()
    first_key = next(iter(world.headscale.preauth_keys))
    world.headscale.nodes = [registered("7", first_key)]
    await world.reconcile_ingress()  # the node is seen while its key is current
    for _ in range(2):  # two rotations at half-life: the first key is neither current nor previous
        world.clock.advance(timedelta(hours=13).total_seconds())
        await world.reconcile_ingress()
    assert len(world.headscale.preauth_keys) == 3
    withdraw_tenancy(world)

    await world.reconcile_ingress()

    assert world.cond("Ready")["reason"] == "NamespaceNotTenant"
    assert world.headscale.nodes == [], "the agent's node registered with a retired key is still on the tailnet"
