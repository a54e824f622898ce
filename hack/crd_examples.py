"""Objects that must be rejected, derived from the samples by one change each.

One table serves the unit tests (pydantic must reject each object) and the e2e tests (the real
apiserver must answer 422 naming ``field``), which keeps the models and the CRD's OpenAPI/CEL
rules in agreement; the table also documents every rule with a concrete example.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hack.crds import load_samples
from tailnet_operator.types import JSON

Obj = JSON


@dataclass(frozen=True)
class InvalidExample:
    """A sample of ``kind`` broken by ``mutate``; ``field`` is the path the error must name."""

    id: str
    kind: str
    field: str
    mutate: Callable[[Obj], None]

    def build(self) -> Obj:
        """A fresh copy of the kind's sample with the defect applied."""
        samples = {s["kind"]: s for s in load_samples()}
        obj = copy.deepcopy(samples[self.kind])
        obj["metadata"]["name"] = f"invalid-{self.id}"
        self.mutate(obj)
        return obj


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    """Set a dotted path (``spec.targets.0.address``); list indexes are numbers."""

    def apply(obj: Obj) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return apply


def _delete(path: str) -> Callable[[Obj], None]:
    def apply(obj: Obj) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return apply


def _both(*changes: Callable[[Obj], None]) -> Callable[[Obj], None]:
    def apply(obj: Obj) -> None:
        for change in changes:
            change(obj)

    return apply


_PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"

INVALID_EXAMPLES: tuple[InvalidExample, ...] = (
    # Tailnet
    InvalidExample(
        "tn-cidr", "Tailnet", "spec.reservedNetworks[1]", _set("spec.reservedNetworks.1", "10.244.0.0/33")
    ),
    InvalidExample(
        "tn-hostbits", "Tailnet", "spec.reservedNetworks[0]", _set("spec.reservedNetworks.0", "10.96.0.1/12")
    ),
    InvalidExample("tn-no-login", "Tailnet", "spec.loginURL", _delete("spec.loginURL")),
    InvalidExample(
        "tn-login-scheme", "Tailnet", "spec.loginURL", _set("spec.loginURL", "headscale.example.internal")
    ),
    InvalidExample(
        "tn-no-secret-name",
        "Tailnet",
        "spec.bootstrapKeySecretRef.name",
        _delete("spec.bootstrapKeySecretRef.name"),
    ),
    InvalidExample(
        "tn-two-cas",
        "Tailnet",
        "spec.caSecretRef",
        _both(
            _set("spec.caBundle", _PEM),
            _set("spec.caSecretRef", {"namespace": "tailnet-system", "name": "ca"}),
        ),
    ),
    InvalidExample("tn-days", "Tailnet", "spec.apiKeyLifetime", _set("spec.apiKeyLifetime", "90d")),
    InvalidExample("tn-short-key", "Tailnet", "spec.apiKeyLifetime", _set("spec.apiKeyLifetime", "30m")),
    InvalidExample("tn-mode", "Tailnet", "spec.policy.mode", _set("spec.policy.mode", "Enforce")),
    # TailnetEgress
    InvalidExample("eg-tag", "TailnetEgress", "spec.tag", _set("spec.tag", "egress-branch1")),
    InvalidExample("eg-tag-case", "TailnetEgress", "spec.tag", _set("spec.tag", "tag:Egress")),
    InvalidExample("eg-no-targets", "TailnetEgress", "spec.targets", _delete("spec.targets")),
    InvalidExample("eg-zero-replicas", "TailnetEgress", "spec.replicas", _set("spec.replicas", 0)),
    InvalidExample("eg-many-replicas", "TailnetEgress", "spec.replicas", _set("spec.replicas", 11)),
    InvalidExample(
        "eg-no-consumers", "TailnetEgress", "spec.consumerNamespaces", _set("spec.consumerNamespaces", [])
    ),
    InvalidExample(
        "eg-address",
        "TailnetEgress",
        "spec.targets[0].address",
        _set("spec.targets.0.address", "db at branch1"),
    ),
    InvalidExample(
        "eg-address-numeric",
        "TailnetEgress",
        "spec.targets[0].address",
        _set("spec.targets.0.address", "10.20.300.4"),
    ),
    InvalidExample(
        "eg-port",
        "TailnetEgress",
        "spec.targets[0].ports[0].port",
        _set("spec.targets.0.ports.0.port", 70000),
    ),
    InvalidExample(
        "eg-udp",
        "TailnetEgress",
        "spec.targets[0].ports[0].protocol",
        _set("spec.targets.0.ports.0.protocol", "UDP"),
    ),
    InvalidExample(
        "eg-dup-target", "TailnetEgress", "spec.targets[1]", _set("spec.targets.1.name", "branch-db")
    ),
    InvalidExample(
        "eg-dup-port-name",
        "TailnetEgress",
        "spec.targets[0].ports",
        _set("spec.targets.0.ports", [{"port": 5432, "name": "pg"}, {"port": 5433, "name": "pg"}]),
    ),
    # TailnetIngress
    InvalidExample("in-tag", "TailnetIngress", "spec.tag", _set("spec.tag", "ingress-observability")),
    InvalidExample("in-no-hostname", "TailnetIngress", "spec.hostname", _delete("spec.hostname")),
    InvalidExample(
        "in-http-no-hosts", "TailnetIngress", "spec.exposes[0].hosts", _delete("spec.exposes.0.hosts")
    ),
    InvalidExample(
        "in-tcp-hosts",
        "TailnetIngress",
        "spec.exposes[1].hosts",
        _set(
            "spec.exposes.1.hosts",
            [{"name": "loki.apps.example.internal", "tls": {"secretName": "loki-tls"}}],
        ),
    ),
    InvalidExample(
        "in-two-certs",
        "TailnetIngress",
        "spec.exposes[0].hosts[0].tls",
        _set("spec.exposes.0.hosts.0.tls.secretName", "grafana-tls"),
    ),
    InvalidExample(
        "in-no-cert", "TailnetIngress", "spec.exposes[0].hosts[0].tls", _set("spec.exposes.0.hosts.0.tls", {})
    ),
    InvalidExample(
        "in-ca-plain-http",
        "TailnetIngress",
        "spec.exposes[0].backend.caSecretRef",
        _set("spec.exposes.0.backend.caSecretRef", {"name": "grafana-ca"}),
    ),
    InvalidExample(
        "in-tcp-https",
        "TailnetIngress",
        "spec.exposes[1].backend",
        _set("spec.exposes.1.backend.scheme", "https"),
    ),
    InvalidExample(
        "in-tcp-h2",
        "TailnetIngress",
        "spec.exposes[1].backend",
        _set("spec.exposes.1.backend.protocol", "h2"),
    ),
    InvalidExample("in-port-clash", "TailnetIngress", "spec.exposes", _set("spec.exposes.1.port", 443)),
    InvalidExample(
        "in-template", "TailnetIngress", "spec.dnsTemplate", _set("spec.dnsTemplate", "{hostname}..example")
    ),
    InvalidExample("in-replicas-unshared", "TailnetIngress", "spec.replicas", _set("spec.replicas", 2)),
    InvalidExample("in-many-replicas", "TailnetIngress", "spec.replicas", _set("spec.replicas", 11)),
    InvalidExample("in-shared-tailnet-range", "TailnetIngress", "spec.sharedAddress",
                   _set("spec.sharedAddress", "100.64.3.3")),
    InvalidExample("in-shared-loopback", "TailnetIngress", "spec.sharedAddress",
                   _set("spec.sharedAddress", "127.0.0.1")),
    InvalidExample("in-path-two-targets", "TailnetIngress", "spec.exposes[0].hosts[0].paths[0]",
                   _set("spec.exposes.0.hosts.0.paths", [{"path": "/", "backend": {"service": "a", "port": 1},
                                                          "redirect": {"statusCode": 301}}])),
    InvalidExample("in-path-no-target", "TailnetIngress", "spec.exposes[0].hosts[0].paths[0]",
                   _set("spec.exposes.0.hosts.0.paths", [{"path": "/"}])),
    InvalidExample("in-path-identity-header", "TailnetIngress",
                   "spec.exposes[0].hosts[0].paths[0].requestHeaders.set[0].name",
                   _set("spec.exposes.0.hosts.0.paths", [{"path": "/", "backend": {"service": "a", "port": 1},
                                                          "requestHeaders": {"set": [
                                                              {"name": "Tailnet-User-Login", "value": "x"}]}}])),
    InvalidExample("in-path-exact-prefix-rewrite", "TailnetIngress", "spec.exposes[0].hosts[0].paths[0]",
                   _set("spec.exposes.0.hosts.0.paths", [{"path": "/a", "pathType": "Exact",
                                                          "backend": {"service": "a", "port": 1},
                                                          "rewrite": {"path": {"type": "ReplacePrefixMatch",
                                                                               "value": "/"}}}])),
    InvalidExample("in-plaintext-tls", "TailnetIngress", "spec.exposes[0].hosts",
                   _set("spec.exposes.0.plaintext", True)),
    InvalidExample("in-plaintext-tcp", "TailnetIngress", "spec.exposes[1].plaintext",
                   _set("spec.exposes.1.plaintext", True)),
    InvalidExample("in-host-no-tls", "TailnetIngress", "spec.exposes[0].hosts",
                   _delete("spec.exposes.0.hosts.0.tls")),
    InvalidExample("in-wildcard-host-alias", "TailnetIngress", "spec.exposes[0].hosts[0].alias",
                   _set("spec.exposes.0.hosts", [{"name": "*.apps.example.internal", "alias": "web",
                                                  "tls": {"secretName": "web-tls"}}])),
    InvalidExample("in-wildcard-host-bare", "TailnetIngress", "spec.exposes[0].hosts[0].name",
                   _set("spec.exposes.0.hosts.0.name", "*apps.example.internal")),
    InvalidExample("in-any-host-alias", "TailnetIngress", "spec.exposes[0].hosts[0].alias",
                   _both(_set("spec.exposes.0.hosts", [{"name": "*", "alias": "web"}]),
                         _set("spec.exposes.0.plaintext", True))),
    InvalidExample("in-tls-cert", "TailnetIngress", "spec.exposes[0].hosts", _set("spec.exposes.0.mode", "tls")),
    InvalidExample("in-tls-paths", "TailnetIngress", "spec.exposes[0].hosts",
                   _both(_set("spec.exposes.0.mode", "tls"),
                         _set("spec.exposes.0.hosts", [{"name": "grafana.apps.example.internal", "paths": [
                             {"path": "/", "backend": {"service": "a", "port": 1}}]}]))),
    InvalidExample("in-tls-no-hosts", "TailnetIngress", "spec.exposes[1].hosts", _set("spec.exposes.1.mode", "tls")),
    InvalidExample("in-tls-https", "TailnetIngress", "spec.exposes[1].backend",
                   _both(_set("spec.exposes.1.mode", "tls"),
                         _set("spec.exposes.1.hosts", [{"name": "loki.apps.example.internal"}]),
                         _set("spec.exposes.1.backend.scheme", "https"))),
    InvalidExample("in-tls-port-of-http", "TailnetIngress", "spec.exposes",
                   _both(_set("spec.exposes.1.mode", "tls"), _set("spec.exposes.1.port", 443),
                         _set("spec.exposes.1.hosts", [{"name": "loki.apps.example.internal"}]))),
    InvalidExample("in-path-status", "TailnetIngress", "spec.exposes[0].hosts[0].paths[0].redirect.statusCode",
                   _set("spec.exposes.0.hosts.0.paths", [{"path": "/", "redirect": {"statusCode": 200}}])),
    # TailnetSite
    InvalidExample("st-cidr", "TailnetSite", "spec.routes[1]", _set("spec.routes.1", "192.168.50.300/24")),
    InvalidExample("st-hostbits", "TailnetSite", "spec.routes[0]", _set("spec.routes.0", "192.168.50.1/24")),
    InvalidExample("st-default", "TailnetSite", "spec.routes[0]", _set("spec.routes.0", "0.0.0.0/0")),
    InvalidExample("st-tag", "TailnetSite", "spec.routerTag", _set("spec.routerTag", "site-branch1")),
    InvalidExample("st-no-routes", "TailnetSite", "spec.routes", _set("spec.routes", [])),
    InvalidExample("st-no-tailnet", "TailnetSite", "spec.tailnetRef", _delete("spec.tailnetRef")),
    InvalidExample(
        "st-overlap", "TailnetSite", "spec.routes", _set("spec.routes", ["192.168.0.0/16", "192.168.50.0/24"])
    ),
    # TailnetGateway
    InvalidExample(
        "gw-cidr", "TailnetGateway", "spec.siteRoutes[0]", _set("spec.siteRoutes.0", "192.168.10.0/24/1")
    ),
    InvalidExample(
        "gw-lb-prefix",
        "TailnetGateway",
        "spec.advertiseLoadBalancerRange",
        _set("spec.advertiseLoadBalancerRange", "10.250.0.0"),
    ),
    InvalidExample(
        "gw-tag",
        "TailnetGateway",
        "spec.tag",
        _set("spec.tag", "tag:"),
    ),
    InvalidExample("gw-image", "TailnetGateway", "spec.image", _set("spec.image", "not an image")),
    InvalidExample(
        "gw-lb-overlap",
        "TailnetGateway",
        "spec.advertiseLoadBalancerRange",
        _set("spec.advertiseLoadBalancerRange", "198.18.10.128/25"),
    ),
    InvalidExample(
        "gw-policy", "TailnetGateway", "spec.deletionPolicy", _set("spec.deletionPolicy", "Orphan")
    ),
)
