"""Pure builders of what one TailnetGateway creates: desired state in, manifest dicts out.

Everything lives in the gateway namespace (``Router.namespace``), which must admit the
``privileged`` Pod Security level: the router is a kernel-mode tailscaled, which needs the TUN
device (a ``hostPath``) and the ``NET_ADMIN`` capability, both beyond ``baseline``. It runs no
privileged container and no other capability (every other one dropped, no privilege escalation,
the runtime's default seccomp profile, a read-only root filesystem), from the image the operator
is configured with (``Router.image``), never one a TailnetGateway names. IP forwarding is the
pod's network namespace's own: inherited from the node (IPv4), or set with the pod's ``sysctls``
where the kubelet allows them (``Router.forwarding_sysctls``). Each router has its own
ServiceAccount and a Role that reaches its own state Secret only (``resourceNames``). The
CoreDNS next to it meets ``restricted``.

The objects carry labels, not ownerReferences: the garbage collector must never remove the
router with its TailnetGateway (``deletionPolicy: Retain`` leaves it running), so the Gateway
reconciler deletes them itself under ``deletionPolicy: Delete``.

The router runs tailscaled from the tailscale image (``ROUTER_SCRIPT``): it keeps its state
(machine and node keys, profile) in the state Secret through its Kubernetes state store
(``--state=kube:<secret>``), so a pod that is deleted comes back as the same node. The
StatefulSet's update strategy is ``OnDelete``: a changed template (image, routes) reaches the pod
only when a person deletes it; the operator never does.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tailnet_agent.contract.addresses import host_route
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL, auth_key_secret_name

from . import http_probe, restricted_pod_security_context, restricted_security_context

__all__ = [
    "DEFAULT_ROUTER_IMAGE",
    "DNS_HEALTH_PORT",
    "DNS_PORT",
    "DNS_READY_PORT",
    "FORWARDING_SYSCTLS",
    "KEY_IDS_ANNOTATION",
    "OWNER_UID_ANNOTATION",
    "ROUTER_CAPABILITIES",
    "STATE_SECRET_ANNOTATION",
    "TEMPLATE_HASH_ANNOTATION",
    "WIREGUARD_PORT",
    "Router",
    "advertised_routes",
    "auth_key_metadata",
    "auth_key_secret",
    "config_map",
    "corefile",
    "dns_deployment",
    "dns_labels",
    "dns_name",
    "dns_service",
    "gateway_labels",
    "host_route",
    "key_ids",
    "pod_name",
    "router_labels",
    "router_name",
    "router_role",
    "router_role_binding",
    "router_security_context",
    "router_service",
    "router_service_account",
    "router_service_account_name",
    "state_secret",
    "state_secret_name",
    "stateful_set",
    "template_hash",
]

Obj = dict[str, Any]

DNS_PORT = 1053
"""CoreDNS listens on an unprivileged port (no NET_BIND_SERVICE); its Service maps 53 to it."""
DNS_HEALTH_PORT = 8080
DNS_READY_PORT = 8181
DNS_UID = 65532
WIREGUARD_PORT = 41641
CONFIG_DIR = "/etc/coredns"
CA_DIR = "/etc/tailnet-gateway/ca"
COREFILE = "Corefile"
ZONE_FILE = "zone.db"
CA_FILE = "ca.crt"
TUN = "/dev/net/tun"
TMP = "/tmp"
SOA_TTL = 30

DEFAULT_ROUTER_IMAGE = "docker.io/tailscale/tailscale:v1.98.10"
"""The router's image unless the operator is told another (``--gateway-router-image``): the
tailscale image, which has tailscaled, its CLI and a shell."""
ROUTER_CAPABILITIES = ("NET_ADMIN",)
"""All the router keeps: the TUN device, addresses, routes and the packet filter (netlink)."""
FORWARDING_SYSCTLS = (("net.ipv4.ip_forward", "1"), ("net.ipv6.conf.all.forwarding", "1"))
"""Set on the pod with ``Router.forwarding_sysctls``; the kubelet must allow both
(``--allowed-unsafe-sysctls``: neither is on its list of safe sysctls)."""

GATEWAY_LABEL = "tailnet.dev/gateway"
"""On every object of a gateway: the TailnetGateway that made it (the reconciler's watches map by it)."""
TEMPLATE_HASH_ANNOTATION = "tailnet.dev/template-hash"
"""On the pod template: what the pod was started from; compared with the desired template."""
OWNER_UID_ANNOTATION = "tailnet.dev/gateway-uid"
"""On the state Secret: the uid of the TailnetGateway that created it (anything else is not adopted)."""
STATE_SECRET_ANNOTATION = "tailnet.dev/state-of"
"""On the state Secret: which gateway's router keeps its state there, for people."""
KEY_IDS_ANNOTATION = "tailnet.dev/pre-auth-key-ids"
"""On the state Secret: every pre-auth key minted for this router (a node registered with any of
them is the router, even if a rotation replaced that key meanwhile)."""


@dataclass(frozen=True)
class Router:
    """What the router's objects depend on besides the TailnetGateway."""

    namespace: str
    """The gateway namespace (Pod Security ``privileged``)."""
    tailnet: str
    control_url: str
    image: str = DEFAULT_ROUTER_IMAGE
    """The operator's configuration, not the TailnetGateway's (its ``spec.image`` is ignored)."""
    routes: tuple[str, ...] = ()
    ca_bundle: str | None = None
    forwarding_sysctls: bool = False
    """Set IP forwarding with the pod's ``sysctls`` (the nodes' kubelets must allow them)."""


def _name(gateway: TailnetGateway | str) -> str:
    """The TailnetGateway's name (the names below take the object or, for one that may no longer
    parse, such as one being deleted, its name)."""
    return gateway if isinstance(gateway, str) else str(gateway.metadata.name)


def router_name(gateway: TailnetGateway | str) -> str:
    """The StatefulSet and its headless Service."""
    return f"{_name(gateway)}-gateway"


def pod_name(gateway: TailnetGateway | str) -> str:
    return f"{router_name(gateway)}-0"


def state_secret_name(gateway: TailnetGateway | str) -> str:
    return f"{router_name(gateway)}-state"


def auth_key_secret(gateway: TailnetGateway | str) -> str:
    """The router's pre-auth key Secret (:func:`tailnet_operator.names.auth_key_secret_name`)."""
    return auth_key_secret_name("TailnetGateway", _name(gateway))


def dns_name(gateway: TailnetGateway | str) -> str:
    """The CoreDNS Deployment, its Service and its ConfigMap."""
    return f"{router_name(gateway)}-dns"


def gateway_labels(gateway: TailnetGateway) -> dict[str, str]:
    """On every object of the gateway: the Gateway reconciler's watches map them back by these."""
    return {**MANAGED_BY, "app.kubernetes.io/name": "tailnet-gateway", "app.kubernetes.io/instance": _name(gateway),
            GATEWAY_LABEL: _name(gateway), TAILNET_LABEL: gateway.spec.tailnet_ref.name}


def router_service_account_name(gateway: TailnetGateway | str) -> str:
    """The router's own ServiceAccount, Role and RoleBinding."""
    return router_name(gateway)


def router_labels(gateway: TailnetGateway) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tailnet-gateway", "app.kubernetes.io/instance": _name(gateway),
            "app.kubernetes.io/component": "router"}


def dns_labels(gateway: TailnetGateway) -> dict[str, str]:
    return {"app.kubernetes.io/name": "tailnet-gateway", "app.kubernetes.io/instance": _name(gateway),
            "app.kubernetes.io/component": "dns"}


def _metadata(gateway: TailnetGateway, name: str, namespace: str, component: str,
              annotations: dict[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": namespace,
                 "labels": {**gateway_labels(gateway), "app.kubernetes.io/component": component}}
    if annotations:
        meta["annotations"] = annotations
    return meta


def auth_key_metadata(gateway: TailnetGateway, namespace: str) -> Obj:
    """metadata of the pre-auth key's Secret (the key keeper adds its annotations)."""
    return _metadata(gateway, auth_key_secret(gateway), namespace, "router")


# -- routes ---------------------------------------------------------------------------------------


def advertised_routes(gateway: TailnetGateway, egress_addresses: Iterable[str],
                      dns_address: str | None = None) -> tuple[str, ...]:
    """What the router advertises: ``siteRoutes``, ``advertiseLoadBalancerRange``, a host route
    for every egress target given by IP (names are skipped) and for the CoreDNS Service; sorted,
    without duplicates, so equal input gives an equal pod template."""
    nets: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    for route in [*(gateway.spec.site_routes or []), gateway.spec.advertise_load_balancer_range]:
        if route:
            nets.add(ipaddress.ip_network(route, strict=False))
    for address in [*egress_addresses, dns_address or ""]:
        if route := host_route(address):
            nets.add(ipaddress.ip_network(route))
    return tuple(str(n) for n in sorted(nets, key=lambda n: (n.version, n.network_address, n.prefixlen)))


def key_ids(state: Obj | None) -> set[str]:
    """The pre-auth key ids the state Secret records."""
    notes = ((state or {}).get("metadata") or {}).get("annotations") or {}
    return {i for i in str(notes.get(KEY_IDS_ANNOTATION, "")).split(",") if i}


# -- the router -----------------------------------------------------------------------------------


def state_secret(gateway: TailnetGateway, namespace: str, owner_uid: str, key_ids: Iterable[str] = ()) -> Obj:
    """The Secret tailscaled's Kubernetes state store fills: created empty, once; afterwards the
    operator only adds key ids to its annotations (the data is tailscaled's)."""
    notes = {OWNER_UID_ANNOTATION: owner_uid, STATE_SECRET_ANNOTATION: f"TailnetGateway {_name(gateway)}"}
    if ids := sorted(set(key_ids), key=lambda i: (len(i), i)):
        notes[KEY_IDS_ANNOTATION] = ",".join(ids)
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": _metadata(gateway, state_secret_name(gateway), namespace, "router", notes),
            "type": "Opaque"}


def router_service_account(gateway: TailnetGateway, namespace: str) -> Obj:
    """The router pod's identity: its Role reaches its own state Secret and nothing else."""
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _metadata(gateway, router_service_account_name(gateway), namespace, "router")}


def router_role(gateway: TailnetGateway, namespace: str) -> Obj:
    """``get``, ``update`` and ``patch`` on the router's state Secret, by name: tailscaled's
    Kubernetes state store reads it at start and writes every state change back. No ``create``:
    a router whose Secret was deleted cannot make a new one and register a new node; and no other
    router's Secret (its node keys) is within reach."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _metadata(gateway, router_service_account_name(gateway), namespace, "router"),
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": [state_secret_name(gateway)],
                       "verbs": ["get", "update", "patch"]}]}


def router_role_binding(gateway: TailnetGateway, namespace: str) -> Obj:
    name = router_service_account_name(gateway)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": _metadata(gateway, name, namespace, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}


ROUTER_SCRIPT = """\
set -eu
if [ "$(cat /proc/sys/net/ipv4/ip_forward)" != 1 ]; then
  echo "tailnet-gateway: IPv4 forwarding is off in this pod's network namespace, so no route could be" \\
    "served; the node must have net.ipv4.ip_forward=1 (pods inherit it), or the operator must set it with" \\
    "the pod's sysctls (chart value gateway.router.forwardingSysctls, which the kubelet must allow)" >&2
  exit 1
fi
case "$TS_ROUTES" in *:*)
  if [ "$(cat /proc/sys/net/ipv6/conf/all/forwarding)" != 1 ]; then
    echo "tailnet-gateway: IPv6 forwarding is off in this pod's network namespace: the IPv6 routes are" \\
      "advertised but not served (chart value gateway.router.forwardingSysctls sets it)" >&2
  fi
esac
sock=/tmp/tailscaled.sock
mkdir -p /tmp/tailscale
tailscaled --state="kube:${TS_KUBE_SECRET}" --statedir=/tmp/tailscale --socket="$sock" &
pid=$!
trap 'kill -TERM "$pid"; wait "$pid"' TERM INT
until [ -S "$sock" ]; do kill -0 "$pid"; sleep 0.2; done
tailscale --socket="$sock" up --login-server="$TS_LOGIN_SERVER" --hostname="$TS_HOSTNAME" \\
  --advertise-routes="$TS_ROUTES" --accept-dns=false --timeout=120s ${TS_AUTHKEY:+--authkey="$TS_AUTHKEY"}
wait "$pid"
"""
"""The router's entry point: it stops at once, saying why, when IPv4 forwarding is off in the
pod's network namespace (a router that cannot forward would register and serve nothing); then
tailscaled in kernel mode with its state in the state Secret (``--state=kube:<secret>``,
tailscaled's Kubernetes state store, through the pod's ServiceAccount), then ``tailscale up``
with the login server, hostname and routes. A first start logs in with the pre-auth key; a
restart finds the node's keys in the Secret and comes back as the same node (with no key at all:
the key is expired and its Secret deleted once the node registered)."""


def _router_env(gateway: TailnetGateway, router: Router) -> list[Obj]:
    env: list[Obj] = [
        {"name": "TS_KUBE_SECRET", "value": state_secret_name(gateway)},
        {"name": "TS_AUTHKEY", "valueFrom": {"secretKeyRef": {"name": auth_key_secret(gateway), "key": "authKey",
                                                              "optional": True}}},
        {"name": "TS_LOGIN_SERVER", "value": router.control_url},
        {"name": "TS_HOSTNAME", "value": router_name(gateway)},
        {"name": "TS_ROUTES", "value": ",".join(router.routes)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    if router.ca_bundle:
        env.append({"name": "SSL_CERT_FILE", "value": f"{CA_DIR}/{CA_FILE}"})
    return env


def router_security_context() -> Obj:
    """The router container's: root (tailscaled configures the kernel's network) with only
    :data:`ROUTER_CAPABILITIES`, no privilege escalation, a read-only root filesystem."""
    return {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsUser": 0, "runAsGroup": 0,  # a capability is effective for root only (no ambient ones)
            "capabilities": {"drop": ["ALL"], "add": list(ROUTER_CAPABILITIES)},
            "seccompProfile": {"type": "RuntimeDefault"}}


def _pod_template(gateway: TailnetGateway, router: Router) -> Obj:
    mounts: list[Obj] = [{"name": "tun", "mountPath": TUN}, {"name": "tmp", "mountPath": TMP}]
    volumes: list[Obj] = [{"name": "tun", "hostPath": {"path": TUN, "type": "CharDevice"}},
                          {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    if router.ca_bundle:
        mounts.append({"name": "ca", "mountPath": CA_DIR, "readOnly": True})
        volumes.append({"name": "ca", "configMap": {"name": router_name(gateway),
                                                    "items": [{"key": CA_FILE, "path": CA_FILE}]}})
    pod_security: Obj = {"seccompProfile": {"type": "RuntimeDefault"}}
    if router.forwarding_sysctls:
        pod_security["sysctls"] = [{"name": name, "value": value} for name, value in FORWARDING_SYSCTLS]
    return {
        "metadata": {"labels": {**gateway_labels(gateway), **router_labels(gateway)}},
        "spec": {
            "serviceAccountName": router_service_account_name(gateway),
            "automountServiceAccountToken": True,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 10,
            "securityContext": pod_security,
            "containers": [{
                "name": "tailscale", "image": router.image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", ROUTER_SCRIPT],
                "env": _router_env(gateway, router),
                "ports": [{"name": "wireguard", "containerPort": WIREGUARD_PORT, "protocol": "UDP"}],
                "securityContext": router_security_context(),
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        },
    }


def template_hash(template: Obj) -> str:
    """A digest of a pod template (without its own hash annotation): equal templates, equal hashes."""
    body = json.loads(json.dumps(template))
    meta = body.get("metadata") or {}
    notes = meta.pop("annotations", None) or {}
    notes.pop(TEMPLATE_HASH_ANNOTATION, None)
    if notes:
        meta["annotations"] = notes
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def stateful_set(gateway: TailnetGateway, router: Router) -> Obj:
    """One kernel-mode router pod, ``OnDelete``: a template change waits for a person's restart."""
    template = _pod_template(gateway, router)
    template["metadata"]["annotations"] = {TEMPLATE_HASH_ANNOTATION: template_hash(template)}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _metadata(gateway, router_name(gateway), router.namespace, "router"),
        "spec": {
            "replicas": 1, "serviceName": router_name(gateway),
            "selector": {"matchLabels": router_labels(gateway)},
            "updateStrategy": {"type": "OnDelete"},
            "template": template,
        },
    }


def router_service(gateway: TailnetGateway, router: Router) -> Obj:
    """The StatefulSet's governing headless Service (stable pod DNS name)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(gateway, router_name(gateway), router.namespace, "router"),
            "spec": {"clusterIP": "None", "selector": router_labels(gateway), "publishNotReadyAddresses": True,
                     "ports": [{"name": "wireguard", "port": WIREGUARD_PORT, "protocol": "UDP",
                                "targetPort": WIREGUARD_PORT}]}}


# -- the zone -------------------------------------------------------------------------------------


def corefile(zone: str, *, directory: str = CONFIG_DIR, port: int = DNS_PORT, health_port: int = DNS_HEALTH_PORT,
             ready_port: int = DNS_READY_PORT) -> str:
    """Serve ``zone`` authoritatively from its zone file: names in it answer, every other name of
    the zone is NXDOMAIN with the zone's SOA; nothing is forwarded anywhere.

    The ``file`` plugin, not ``hosts``: ``hosts`` has no SOA, so it can only answer a missing name
    with SERVFAIL or pass it on, and CoreDNS orders plugins by its build, not by the Corefile (a
    ``template`` that answers NXDOMAIN runs before ``hosts`` and would hide every name).
    """
    z = _zone(zone)
    return (f"{z}:{port} {{\n"
            "    errors\n"
            f"    health :{health_port}\n"
            f"    ready :{ready_port}\n"
            "    reload 10s\n"
            f"    file {directory}/{ZONE_FILE} {z} {{\n"
            "        reload 5s\n"
            "    }\n"
            "}\n")


def zone_file(zone: str, entries: Mapping[str, str]) -> str:
    """The zone's records for ``{name: address}`` (names of the zone; A or AAAA by the address).

    Deterministic: sorted records, and an SOA serial derived from them, so CoreDNS (which reloads
    when the serial differs) picks up every change and an unchanged file is byte for byte the same.
    """
    z = _zone(zone)
    names = {name.lower().rstrip("."): address for name, address in entries.items()}
    records = "".join(
        f"{name}. {SOA_TTL} IN {'AAAA' if ipaddress.ip_address(address).version == 6 else 'A'} {address}\n"
        for name, address in sorted(names.items()))
    serial = int.from_bytes(hashlib.sha256(records.encode()).digest()[:4], "big") % 0xFFFFFFFF + 1
    return (f"$ORIGIN {z}.\n"
            f"@ {SOA_TTL} IN SOA ns.{z}. hostmaster.{z}. {serial} 7200 1800 86400 {SOA_TTL}\n" + records)


def _zone(zone: str) -> str:
    return zone.lower().rstrip(".")


def config_map(gateway: TailnetGateway, router: Router, entries: Mapping[str, str]) -> Obj:
    """``<gateway>-gateway``: the CA bundle the router trusts Headscale with (when there is one)
    and, with ``spec.dns``, the Corefile and the zone file made from the Tailnet's hosts file
    (``entries``: its names of the zone; a pod mounts only ConfigMaps of its own namespace)."""
    data: dict[str, str] = {}
    if gateway.spec.dns:
        data = {COREFILE: corefile(gateway.spec.dns.zone), ZONE_FILE: zone_file(gateway.spec.dns.zone, entries)}
    if router.ca_bundle:
        data[CA_FILE] = router.ca_bundle
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(gateway, router_name(gateway), router.namespace, "router"), "data": data}


def dns_deployment(gateway: TailnetGateway, router: Router) -> Obj:
    assert gateway.spec.dns is not None
    labels = dns_labels(gateway)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(gateway, dns_name(gateway), router.namespace, "dns"),
        "spec": {
            "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": {**gateway_labels(gateway), **labels}}, "spec": {
                "automountServiceAccountToken": False, "enableServiceLinks": False,
                "securityContext": restricted_pod_security_context(DNS_UID),
                "containers": [{
                    "name": "coredns", "image": gateway.spec.dns.image, "imagePullPolicy": "IfNotPresent",
                    "args": ["-conf", f"{CONFIG_DIR}/{COREFILE}"],
                    "ports": [{"name": "dns", "containerPort": DNS_PORT, "protocol": "UDP"},
                              {"name": "dns-tcp", "containerPort": DNS_PORT, "protocol": "TCP"}],
                    "livenessProbe": http_probe("/health", DNS_HEALTH_PORT, 10),
                    "readinessProbe": http_probe("/ready", DNS_READY_PORT, 5),
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                    "securityContext": restricted_security_context(DNS_UID),
                    "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
                }],
                "volumes": [{"name": "config", "configMap": {
                    "name": router_name(gateway),
                    "items": [{"key": COREFILE, "path": COREFILE}, {"key": ZONE_FILE, "path": ZONE_FILE}]}}],
            }},
        },
    }


def dns_service(gateway: TailnetGateway, router: Router) -> Obj:
    """Port 53 of the zone's nameserver; its ClusterIP is what the router advertises as a /32."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(gateway, dns_name(gateway), router.namespace, "dns"),
            "spec": {"type": "ClusterIP", "selector": dns_labels(gateway),
                     "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": DNS_PORT},
                               {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": DNS_PORT}]}}
