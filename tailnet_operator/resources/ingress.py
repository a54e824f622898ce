"""Pure builders of what one TailnetIngress owns: desired state in, manifest dicts out.

The agent runs in the CR's namespace with ``AGENT_MODE=ingress``. Its exposes live in a mounted
ConfigMap in the agent's exposes-file format (:mod:`tailnet_agent.contract.exposes`), which the agent
reloads, so adding, changing or removing an expose never restarts the pod. Every host's TLS
Secret (its own ``tls.secretName``, or the one cert-manager fills for ``tls.certManager``) and
every https backend's CA are projected into one directory; kubelet updates projected files in
place and the agent reloads a certificate whose files change, so a renewed certificate reaches
new connections without a restart. The Secrets are optional in the projection: a certificate
cert-manager has not issued yet does not keep the pod (and its tcp exposes) from starting.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract import exposes as agent_exposes
from tailnet_operator import names
from tailnet_operator.api.common import ANY_HOST
from tailnet_operator.api.ingress import (
    Expose,
    HeaderEdits,
    HeaderMatch,
    HeaderValue,
    HostPath,
    PathBackend,
    PathChange,
    Redirect,
    Rewrite,
    TailnetIngress,
    VirtualHost,
    render_dns_template,
)
from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL, auth_key_secret_name

from . import agent as pod
from .agent import CONFIG_DIR, AgentSpec

__all__ = [
    "CERTS_DIR",
    "EXPOSES_FILE",
    "AgentSpec",
    "agent_labels",
    "agent_name",
    "agent_service",
    "alias_names",
    "auth_secret",
    "backend_host",
    "certificate",
    "certificate_name",
    "config_map",
    "config_map_name",
    "config_map_name_of",
    "deployment",
    "dns_names",
    "exposes_document",
    "host_secret_name",
    "network_policy",
    "owned_metadata",
    "record_metadata",
    "record_name",
    "tls_secret_names",
]

Obj = dict[str, Any]

EXPOSES_FILE = "exposes.json"
CERTS_DIR = "/etc/tailnet-agent/certs"
_MAX_NAME = 253


def _name(ingress: TailnetIngress) -> str:
    return str(ingress.metadata.name)


def _namespace(ingress: TailnetIngress) -> str:
    return str(ingress.metadata.namespace)


def agent_labels(ingress: TailnetIngress) -> dict[str, str]:
    """The agent pod's labels: what its Service(s) and NetworkPolicy select."""
    return pod.labels("ingress", _name(ingress))


def owned_metadata(owner: Obj, ingress: TailnetIngress, name: str) -> Obj:
    """metadata of an object the ingress owns: its labels and the CR as controller."""
    return pod.owned_metadata(owner, name=name, labels=agent_labels(ingress), tailnet=ingress.spec.tailnet_ref.name)


def agent_name(ingress: TailnetIngress) -> str:
    return names.agent_name("TailnetIngress", _name(ingress))


def config_map_name(ingress: TailnetIngress) -> str:
    return config_map_name_of(_name(ingress))


def config_map_name_of(ingress_name: str) -> str:
    """The exposes ConfigMap of the TailnetIngress ``ingress_name`` (or of a front door's shape, by
    its name alone: found again when the object no longer parses as one its class serves)."""
    return f"{ingress_name}-ingress-config"


RECORD_NAMESPACE_LABEL = "tailnet.dev/ingress-namespace"
RECORD_NAME_LABEL = "tailnet.dev/ingress-name"
NODE_ADDRESS_ANNOTATION = "tailnet.dev/node-address"
"""On the ingress's record: the tailnet address Headscale gave the node its key registered."""


def record_name(namespace: str, name: str) -> str:
    """The ingress's record in the operator's namespace: its pre-auth key bookkeeping and its node's
    address, which the tenant cannot write (a namespace has no dot, so the name is unique)."""
    return _bounded(f"ingress.{namespace}.{name}")


def record_metadata(ingress: TailnetIngress, operator_namespace: str) -> Obj:
    """metadata of the record: no owner (it lives in another namespace; the finalizer removes it)."""
    labels = {**MANAGED_BY, TAILNET_LABEL: ingress.spec.tailnet_ref.name,
              RECORD_NAMESPACE_LABEL: _namespace(ingress)}
    if len(_name(ingress)) <= 63:
        labels[RECORD_NAME_LABEL] = _name(ingress)
    return {"name": record_name(_namespace(ingress), _name(ingress)), "namespace": operator_namespace,
            "labels": labels}


def auth_secret(owner: Obj, ingress: TailnetIngress, key: str) -> Obj:
    """The Secret the agent mounts: the pre-auth key alone (its bookkeeping stays in the record)."""
    name = auth_key_secret_name("TailnetIngress", _name(ingress))
    return {"metadata": owned_metadata(owner, ingress, name), "type": "Opaque",
            "data": {"authKey": base64.b64encode(key.encode()).decode()}}


def _bounded(name: str, suffix: str = "") -> str:
    """``name + suffix`` as an object name: cut with a hash of the whole when it is too long."""
    if len(name) + len(suffix) <= _MAX_NAME:
        return name + suffix
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:_MAX_NAME - len(suffix) - 11].rstrip('.-')}-{digest}{suffix}"


def certificate_name(ingress: TailnetIngress, host: VirtualHost) -> str:
    """The cert-manager Certificate of a ``tls.certManager`` host: ``<ingress>-<host name>``."""
    return _bounded(f"{_name(ingress)}-{host.name.lower()}")


def host_secret_name(ingress: TailnetIngress, host: VirtualHost) -> str:
    """The TLS Secret of a host (of a TLS expose): its ``tls.secretName``, or ``<certificate>-tls``
    for cert-manager."""
    if host.tls is not None and host.tls.secret_name:
        return host.tls.secret_name
    return _bounded(f"{_name(ingress)}-{host.name.lower()}", "-tls")


def _hosts(ingress: TailnetIngress) -> list[VirtualHost]:
    return [h for e in ingress.spec.exposes for h in e.hosts or []]


def tls_hosts(ingress: TailnetIngress) -> list[VirtualHost]:
    """The hosts that have a certificate: those of the TLS http exposes (a plaintext one's have none)."""
    return [h for h in _hosts(ingress) if h.tls is not None]


def cert_manager_hosts(ingress: TailnetIngress) -> list[VirtualHost]:
    """The hosts whose certificate cert-manager issues (``tls.certManager``)."""
    return [h for h in tls_hosts(ingress) if h.tls is not None and h.tls.cert_manager is not None]


def tls_secret_names(ingress: TailnetIngress) -> list[str]:
    """Every TLS host's Secret, in spec order, each once."""
    return list(dict.fromkeys(host_secret_name(ingress, h) for h in tls_hosts(ingress)))


def alias_names(host: VirtualHost, zones: list[str]) -> list[str]:
    """The alias under each of the Tailnet's DNS zones (none without an alias or zones)."""
    if not host.alias:
        return []
    return [f"{host.alias}.{zone.lower().rstrip('.')}" for zone in zones]


def node_dns_name(ingress: TailnetIngress) -> str | None:
    """The node's name under your zone, from ``dnsTemplate`` (None without a template)."""
    if not ingress.spec.dns_template:
        return None
    return render_dns_template(ingress.spec.dns_template, hostname=ingress.spec.hostname,
                               name=_name(ingress), namespace=_namespace(ingress)).lower().rstrip(".")


def dns_names(ingress: TailnetIngress, zones: list[str]) -> list[str]:
    """Every name the hosts file points at the ingress node: the node's ``dnsTemplate`` name, each
    host's name and its alias under each zone; in that order, each once."""
    names = [n for n in [node_dns_name(ingress)] if n]
    for host in _hosts(ingress):
        if not host.name.startswith(ANY_HOST):  # a wildcard host: no name of its own
            names += [host.name.lower().rstrip("."), *alias_names(host, zones)]
    return list(dict.fromkeys(names))


def backend_host(ingress: TailnetIngress, expose: Expose) -> str:
    """The expose's Service as the agent dials it (in the ingress's namespace unless it names another)."""
    return f"{expose.backend.service}.{expose.backend.namespace or _namespace(ingress)}.svc"


def _tls_dir(secret: str) -> str:
    return f"tls/{secret}"


def _ca_path(expose: Expose) -> str:
    return f"ca/{expose.name}/ca.crt"


def _agent_expose(ingress: TailnetIngress, expose: Expose, zones: list[str]) -> agent_exposes.Expose:
    """One expose as the agent reads it: its backend by Service name; an http expose's hosts' files
    in the projection, each host's paths as routes to their Services (spoken to as the expose's
    backend); a tls expose's hosts as names and aliases only."""
    host, port = backend_host(ingress, expose), expose.backend.port
    if expose.mode == "tcp":
        return agent_exposes.Expose(name=expose.name, port=expose.port,
                                    backend=agent_exposes.Backend(host=host, port=port))
    if expose.mode == "tls":  # names only: the backend terminates TLS
        return agent_exposes.Expose(
            name=expose.name, port=expose.port, mode=agent_exposes.TLS,
            backend=agent_exposes.Backend(host=host, port=port),
            hosts=tuple(_agent_host(h, zones) for h in expose.hosts or []))
    ca_file = f"{CERTS_DIR}/{_ca_path(expose)}" if expose.backend.ca_secret_ref is not None else None
    backend = agent_exposes.Backend(host=host, port=port, scheme=expose.backend.scheme,
                                    protocol=expose.backend.protocol, ca_file=ca_file)

    def to(service: PathBackend) -> agent_exposes.Backend:
        namespace = service.namespace or _namespace(ingress)
        return dataclasses.replace(backend, host=f"{service.service}.{namespace}.svc", port=service.port)

    def route(path: HostPath) -> agent_exposes.Route:
        return agent_exposes.Route(
            path=path.path, type=path.path_type, method=path.method,
            backend=to(path.backend) if path.backend else None,
            backends=tuple(agent_exposes.WeightedBackend(backend=to(b), weight=b.weight) for b in path.backends or []),
            headers=_matches(path.headers), query=_matches(path.query_params),
            request_headers=_edits(path.request_headers), response_headers=_edits(path.response_headers),
            redirect=_redirect(path.redirect), rewrite=_rewrite(path.rewrite))

    hosts = []
    for vhost in expose.hosts or []:
        secret_dir = f"{CERTS_DIR}/{_tls_dir(host_secret_name(ingress, vhost))}"
        files = {} if expose.plaintext else {"cert_file": f"{secret_dir}/tls.crt", "key_file": f"{secret_dir}/tls.key"}
        hosts.append(_agent_host(vhost, zones, **files, routes=tuple(route(p) for p in vhost.paths or []),
                                 fallback=vhost.unmatched_paths == "Backend"))
    return agent_exposes.Expose(name=expose.name, port=expose.port, backend=backend, mode=agent_exposes.HTTP,
                                hosts=tuple(hosts), plaintext=expose.plaintext)


def _agent_host(host: VirtualHost, zones: list[str], **more: Any) -> agent_exposes.VirtualHost:
    """A host as the agent reads it: its name, its alias and the alias under each zone, and ``more``."""
    return agent_exposes.VirtualHost(name=host.name.lower(), alias=host.alias or None,
                                     aliases=tuple(alias_names(host, zones)), **more)


def _matches(matches: Sequence[HeaderMatch | HeaderValue] | None) -> tuple[agent_exposes.Match, ...]:
    return tuple(agent_exposes.Match(name=m.name, value=m.value) for m in matches or [])


def _edits(edits: HeaderEdits | None) -> agent_exposes.HeaderEdits:
    if edits is None:
        return agent_exposes.HeaderEdits()
    return agent_exposes.HeaderEdits(set=_matches(edits.set), add=_matches(edits.add),
                                     remove=tuple(edits.remove or []))


def _path_change(change: PathChange | None) -> agent_exposes.PathChange | None:
    return agent_exposes.PathChange(type=change.type, value=change.value) if change else None


def _redirect(redirect: Redirect | None) -> agent_exposes.Redirect | None:
    if redirect is None:
        return None
    return agent_exposes.Redirect(scheme=redirect.scheme, hostname=redirect.hostname, port=redirect.port,
                                  path=_path_change(redirect.path), status=redirect.status_code)


def _rewrite(rewrite: Rewrite | None) -> agent_exposes.Rewrite | None:
    if rewrite is None:
        return None
    return agent_exposes.Rewrite(hostname=rewrite.hostname, path=_path_change(rewrite.path))


def exposes_document(ingress: TailnetIngress, zones: list[str]) -> str:
    """The agent's exposes file (:mod:`tailnet_agent.contract.exposes`), stable for equal input."""
    return agent_exposes.exposes_document(_agent_expose(ingress, e, zones) for e in ingress.spec.exposes)


# -- objects --------------------------------------------------------------------------------------


def config_map(owner: Obj, ingress: TailnetIngress, zones: list[str], ca_bundle: str | None) -> Obj:
    data = {EXPOSES_FILE: exposes_document(ingress, zones)}
    if ca_bundle:
        data[pod.CA_FILE] = ca_bundle
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": owned_metadata(owner, ingress, config_map_name(ingress)), "data": data}


def _certs_volume(ingress: TailnetIngress) -> Obj | None:
    """One projected volume: each host's TLS Secret and each https backend's CA (all optional)."""
    sources: list[Obj] = [
        {"secret": {"name": secret, "optional": True,
                    "items": [{"key": "tls.crt", "path": f"{_tls_dir(secret)}/tls.crt"},
                              {"key": "tls.key", "path": f"{_tls_dir(secret)}/tls.key"}]}}
        for secret in tls_secret_names(ingress)]
    for expose in ingress.spec.exposes:
        if (ref := expose.backend.ca_secret_ref) is not None:
            sources.append({"secret": {"name": ref.name, "optional": True,
                                       "items": [{"key": ref.key, "path": _ca_path(expose)}]}})
    if not sources:
        return None
    return {"name": "certs", "projected": {"defaultMode": 0o440, "sources": sources}}


def deployment(owner: Obj, ingress: TailnetIngress, agent: AgentSpec) -> Obj:
    """``spec.replicas`` agent pods (one unless they share an address, spread over nodes when more);
    the exposes, the key and the certificates are mounted directories."""
    shared = ([{"name": env_names.SHARED_ADDRESS, "value": ingress.spec.shared_address}]
              if ingress.spec.shared_address is not None else [])
    env = [*pod.base_env(agent, mode=env_names.INGRESS, hostname=ingress.spec.hostname),
           {"name": env_names.EXPOSES_FILE, "value": f"{CONFIG_DIR}/{EXPOSES_FILE}"},
           *shared, *pod.common_env(agent)]
    certs = _certs_volume(ingress)
    return pod.deployment(owned_metadata(owner, ingress, agent_name(ingress)), agent_labels(ingress), agent,
                          env=env, config_map=config_map_name(ingress), tag=ingress.spec.tag,
                          volumes=[certs] if certs else [],
                          mounts=[{"name": "certs", "mountPath": CERTS_DIR, "readOnly": True}] if certs else [],
                          replicas=ingress.spec.replicas)


def disruption_budget(owner: Obj, ingress: TailnetIngress) -> Obj | None:
    """:func:`.agent.pod_disruption_budget` for ``spec.replicas``."""
    return pod.pod_disruption_budget(owned_metadata(owner, ingress, agent_name(ingress)), agent_labels(ingress),
                                     ingress.spec.replicas)


def agent_service(owner: Obj, ingress: TailnetIngress) -> Obj:
    """The agent's health port: the operator reads /status there, Prometheus /metrics."""
    return pod.status_service(owned_metadata(owner, ingress, agent_name(ingress)), agent_labels(ingress))


def network_policy(owner: Obj, ingress: TailnetIngress, agent: AgentSpec, operator_namespace: str) -> Obj:
    """No pod reaches the agent but the operator (its health port): ingress traffic arrives over
    the tailnet, through connections the agent itself opened to DERP or its peers. Egress stays
    open: the agent dials its backends' Services, Headscale and DERP, wherever those are."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": owned_metadata(owner, ingress, agent_name(ingress)),
            "spec": {"podSelector": {"matchLabels": agent_labels(ingress)}, "policyTypes": ["Ingress"],
                     "ingress": pod.health_network_policy_rule(agent, operator_namespace)}}


def certificate(owner: Obj, ingress: TailnetIngress, host: VirtualHost, zones: list[str]) -> Obj:
    """The cert-manager Certificate of a ``tls.certManager`` host: its name and alias names."""
    assert host.tls is not None and host.tls.cert_manager is not None
    issuer = host.tls.cert_manager.issuer_ref
    return {"apiVersion": "cert-manager.io/v1", "kind": "Certificate",
            "metadata": owned_metadata(owner, ingress, certificate_name(ingress, host)),
            "spec": {"secretName": host_secret_name(ingress, host),
                     "dnsNames": list(dict.fromkeys([host.name.lower(), *alias_names(host, zones)])),
                     "issuerRef": {"name": issuer.name, "kind": issuer.kind, "group": issuer.group},
                     "privateKey": {"rotationPolicy": "Always"}}}
