"""Front doors: the time from creating each front-door object to the first request answered through it.

On the local node, with the operator installed in it: a tailscaled "laptop" on the host asks, from
the moment the object is created, for a backend pod (the ``web`` Service, port 8080) through

* a TailnetIngress with a tcp expose (by the address in its ``status.node``),
* a Service of the LoadBalancer class (``status.loadBalancer.ingress``),
* an Ingress of the tailnet IngressClass (``status.loadBalancer.ingress``; HTTPS on 443 with the
  certificate of its TLS Secret, verified),
* a Gateway of the tailnet GatewayClass with an HTTPRoute (``status.addresses``; HTTP on 80),

each polled every 0.2 s: the status read, then one request through the laptop's CONNECT proxy
until it is answered with 200 by the backend. Every kind in turn per round (fresh names each
round, the previous object deleted and its node gone first), so a slow phase of the machine hits
all alike. Everything runs on this machine: the node's addresses are inside 198.18.0.0/15, the
tailnet's are behind the environment's unreachable route.

    python -m benchmarks.frontdoor_ready [--rounds 3] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks.record import commit, load_average, publish
from e2e.cluster import (
    HTTP_SERVER,
    OPEN_BASE,
    ClusterUnderTest,
    apply,
    get_json,
    install_operator_in_cluster,
    kubectl,
    python_pod,
    wait_pod_running,
)
from e2e.operator import tailnet_object
from hack import image, versions
from hack.https_client import request, tunnel
from hack.localenv import Environment, Headscale, TailscaleNode, wait_until
from hack.localenv._pki import CertificateAuthority
from hack.localenv.gatewayapi import crd_bodies

NAMESPACE = "frontdoor"
TAG = "tag:frontdoor"
HOST = "shop.frontdoor.internal"
POLL = 0.2
KINDS = ("TailnetIngress (tcp)", "Service (LoadBalancer class)", "Ingress (IngressClass, HTTPS)",
         "Gateway + HTTPRoute (HTTP)")


@dataclass(frozen=True)
class FrontDoor:
    """One kind: its objects for a round's name, where its status gives the address, how it is asked."""

    kind: str
    objects: Callable[[str], list[dict[str, Any]]]
    resource: str
    """What ``kubectl get`` names for the object whose status carries the address."""
    address: Callable[[dict[str, Any]], str | None]
    ask: Callable[[TailscaleNode, str], int | None]


def _ingress_ip(obj: dict[str, Any]) -> str | None:
    return next((e["ip"] for e in ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
                 if e.get("ip")), None)


def _node_ip(obj: dict[str, Any]) -> str | None:
    return next(iter(((obj.get("status") or {}).get("node") or {}).get("addresses") or []), None)


def _gateway_ip(obj: dict[str, Any]) -> str | None:
    return next((a["value"] for a in (obj.get("status") or {}).get("addresses") or [] if a.get("type") == "IPAddress"),
                None)


async def _plain(laptop: TailscaleNode, address: str, port: int, host: str) -> int:
    reader, writer = await tunnel(laptop.http_proxy_port, address, port)
    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    # Through a tcp expose the backend answers itself, and Python's http.server speaks HTTP/1.0.
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") and b"hello from web" in data else 0


def _asked(attempt: Callable[[], Any]) -> int | None:
    try:
        return int(asyncio.run(asyncio.wait_for(attempt(), 5)))
    except (OSError, TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
        return None


def front_doors(ca: CertificateAuthority, tailnet: str) -> list[FrontDoor]:
    notes = {"tailnet.dev/tag": TAG}

    def tailnet_ingress(name: str) -> list[dict[str, Any]]:
        return [{"apiVersion": "tailnet.dev/v1alpha1", "kind": "TailnetIngress",
                 "metadata": {"name": name, "namespace": NAMESPACE},
                 "spec": {"tailnetRef": {"name": tailnet}, "tag": TAG, "hostname": name,
                          "exposes": [{"name": "web", "port": 8080, "backend": {"service": "web", "port": 8080}}]}}]

    def service(name: str) -> list[dict[str, Any]]:
        return [{"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": name, "namespace": NAMESPACE,
                              "annotations": {**notes, "tailnet.dev/hostname": name}},
                 "spec": {"type": "LoadBalancer", "loadBalancerClass": f"tailnet.dev/{tailnet}",
                          "selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]}}]

    def ingress(name: str) -> list[dict[str, Any]]:
        return [{"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                 "metadata": {"name": name, "namespace": NAMESPACE,
                              "annotations": {**notes, "tailnet.dev/hostname": name}},
                 "spec": {"ingressClassName": "frontdoor", "tls": [{"hosts": [HOST], "secretName": "shop-tls"}],
                          "rules": [{"host": HOST, "http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
                              "service": {"name": "web", "port": {"number": 8080}}}}]}}]}}]

    def gateway(name: str) -> list[dict[str, Any]]:
        return [{"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                 "metadata": {"name": name, "namespace": NAMESPACE,
                              "annotations": {**notes, "tailnet.dev/hostname": name}},
                 "spec": {"gatewayClassName": "frontdoor",
                          "listeners": [{"name": "web", "port": 80, "protocol": "HTTP", "hostname": HOST}]}},
                {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                 "metadata": {"name": name, "namespace": NAMESPACE},
                 "spec": {"parentRefs": [{"name": name}],
                          "rules": [{"backendRefs": [{"name": "web", "port": 8080}]}]}}]

    def https(laptop: TailscaleNode, address: str) -> int | None:
        async def attempt() -> int:
            answer = await request(await tunnel(laptop.http_proxy_port, address, 443), ca=ca.cert_path, sni=HOST)
            return answer.status if answer.body.startswith(b"hello from web") else 0
        return _asked(attempt)

    return [
        FrontDoor(KINDS[0], tailnet_ingress, "tailnetingresses.tailnet.dev", _node_ip,
                  lambda laptop, ip: _asked(lambda: _plain(laptop, ip, 8080, "web"))),
        FrontDoor(KINDS[1], service, "service", _ingress_ip,
                  lambda laptop, ip: _asked(lambda: _plain(laptop, ip, 8080, "web"))),
        FrontDoor(KINDS[2], ingress, "ingress", _ingress_ip, https),
        FrontDoor(KINDS[3], gateway, "gateways.gateway.networking.k8s.io", _gateway_ip,
                  lambda laptop, ip: _asked(lambda: _plain(laptop, ip, 80, HOST))),
    ]


def time_to_answer(cluster: ClusterUnderTest, laptop: TailscaleNode, door: FrontDoor, name: str,
                   timeout: float = 300) -> dict[str, float]:
    """Create the kind's objects; seconds until its status gives an address and until it answers."""
    created = time.monotonic()
    apply(cluster, door.objects(name))
    address: str | None = None
    addressed = 0.0
    deadline = created + timeout
    while time.monotonic() < deadline:
        if address is None:
            address = door.address(get_json(cluster, "-n", NAMESPACE, door.resource, name))
            addressed = time.monotonic() - created
        if address is not None and door.ask(laptop, address) == 200:
            return {"address_s": round(addressed, 2), "answer_s": round(time.monotonic() - created, 2)}
        time.sleep(POLL)
    raise TimeoutError(f"{door.kind} {name}: no answer after {timeout:.0f} s (address {address})")


def _remove(cluster: ClusterUnderTest, headscale: Headscale, door: FrontDoor, name: str) -> None:
    """Delete the round's objects and wait for its node to leave Headscale (the next round starts clean)."""
    kubectl(cluster, "delete", "-f", "-", "--wait=true", "--timeout=120s", "--ignore-not-found",
            stdin=yaml.safe_dump_all(door.objects(name)), check=False)
    wait_until(lambda: not [n for n in headscale.nodes() if str(n.get("givenName", "")).startswith(name)],
               timeout=120, what=f"the node of {name} gone from Headscale")


def _world(cluster: ClusterUnderTest, headscale: Headscale, ns: str, ca: CertificateAuthority,
           image_ref: str) -> str:
    """The Tailnet (open policy; the namespace may use the tag), the classes, the backend, the TLS Secret."""
    tailnet = "frontdoor"
    pair = ca.issue("shop", common_name=HOST, hosts=(HOST,))
    kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(crd_bodies()))
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "frontdoor-bootstrap", "namespace": ns},
         "stringData": {"apiKey": headscale.api_key}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "frontdoor-policy", "namespace": ns},
         "data": {"policy.hujson": OPEN_BASE}},
        tailnet_object(tailnet, headscale, ns, secret="frontdoor-bootstrap",
                       tenants=[{"namespaces": [NAMESPACE], "tags": [TAG]}],
                       policy={"baseConfigMapRef": {"namespace": ns, "name": "frontdoor-policy",
                                                    "key": "policy.hujson"}, "mode": "Apply"}),
        {"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {"name": "frontdoor"},
         "spec": {"controller": "tailnet.dev/ingress-controller",
                  "parameters": {"apiGroup": "tailnet.dev", "kind": "Tailnet", "name": tailnet}}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": "frontdoor"},
         "spec": {"controllerName": "tailnet.dev/gateway-controller",
                  "parametersRef": {"group": "tailnet.dev", "kind": "Tailnet", "name": tailnet}}},
    ])
    wait_until(lambda: kubectl(cluster, "-n", NAMESPACE, "get", "serviceaccount", "default", check=False),
               timeout=60, what="the namespace's ServiceAccount")
    apply(cluster, [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "tailnet-operator", "namespace": NAMESPACE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tailnet-operator-tenant"},
         "subjects": [{"kind": "ServiceAccount", "name": "tailnet-operator", "namespace": ns}]},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "shop-tls", "namespace": NAMESPACE},
         "type": "kubernetes.io/tls", "data": {"tls.crt": base64.b64encode(pair.cert.read_bytes()).decode(),
                                               "tls.key": base64.b64encode(pair.key.read_bytes()).decode()}},
        python_pod("web", NAMESPACE, image_ref, HTTP_SERVER, labels={"app": "web"}, port=8080),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": NAMESPACE},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]}},
    ])
    wait_pod_running(cluster, NAMESPACE, "web")
    return tailnet


def run(rounds: int) -> dict[str, Any]:
    with Environment() as env:
        cluster = env.cluster()
        project = image.project_image()
        cluster.load_image(project)
        headscale = env.headscale("frontdoor-headscale", address=cluster.host_address)
        ns = install_operator_in_cluster(cluster, project.ref, env.root / "install")
        ca = CertificateAuthority(env.root / "pki", "frontdoor")
        tailnet = _world(cluster, headscale, ns, ca, project.ref)  # the image loaded, whatever changed since
        user = headscale.create_user("frontdoor-laptop")
        laptop = env.tailscale_node("frontdoor-laptop", headscale,
                                    authkey=headscale.create_preauth_key(user_id=user["id"]))
        samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
        for number in range(rounds):
            for k, door in enumerate(front_doors(ca, tailnet)):
                name = f"fd{k}-r{number}"
                samples[door.kind].append(time_to_answer(cluster, laptop, door, name))
                _remove(cluster, headscale, door, name)
        return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit(), "rounds": rounds,
                "headscale": versions.HEADSCALE, "tailscale": versions.TAILSCALE, "samples": samples}


def section(doc: dict[str, Any]) -> str:
    lines = [
        f"### Front doors: created to first answer, {doc['date']}, commit {doc['commit']} (local node, Headscale "
        f"{doc['headscale']}, tailscaled {doc['tailscale']})", "",
        "From creating the object to the first request a tailscaled laptop gets answered with 200 by the backend "
        "pod through it (polled every 0.2 s: the status read for the node's address, then one request through "
        "the laptop's proxy), and to the moment the status first gave that address. Each round takes every kind "
        "in turn with fresh names, the previous object deleted and its node gone from Headscale first. "
        f"{doc['rounds']} rounds. {load_average(doc['loadavg_before'], doc['loadavg_after'])}.", "",
        "| front door | address in status p50 s | first answer p50 s | first answer max s | samples (s) |",
        "|---|---|---|---|---|"]
    for kind, rows in doc["samples"].items():
        answers = [r["answer_s"] for r in rows]
        lines.append(f"| {kind} | {statistics.median(r['address_s'] for r in rows):.1f} | "
                     f"{statistics.median(answers):.1f} | {max(answers):.1f} | "
                     f"{', '.join(f'{a:.1f}' for a in answers)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every kind (default 3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    loadavg_before = os.getloadavg()
    doc = run(args.rounds)
    doc |= {"loadavg_before": loadavg_before, "loadavg_after": os.getloadavg()}
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc, name="frontdoor-ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
