"""An ``Ingress`` (networking.k8s.io/v1) of a tailnet IngressClass, translated into the
TailnetIngress it is served as: desired state in, models and manifest pieces out.

The class: an IngressClass whose ``spec.controller`` is :data:`CONTROLLER` and whose
``spec.parameters`` name a Tailnet (``apiGroup: tailnet.dev``, ``kind: Tailnet``, ``name``,
scope ``Cluster`` or unset). An Ingress uses it by ``spec.ingressClassName``; an Ingress without
a class uses it when it is the cluster's one default class (annotation
:data:`DEFAULT_CLASS_ANNOTATION` ``"true"`` on exactly one IngressClass; kube-apiserver's
DefaultIngressClass admission fills the name in for an Ingress created after the class was made
default, this covers those created before). The deprecated ``kubernetes.io/ingress.class``
annotation is not read.

Such an Ingress becomes one tailnet node exactly as a TailnetIngress does (:func:`as_ingress`):

* the node serves HTTPS on port 443 (:data:`HTTPS_PORT`), its TLS terminated with the Secret of
  the ``spec.tls`` entry that lists the host (an entry without hosts covers the rule hosts no
  other entry lists). The agent serves TLS only, picking the host by SNI, so every host of a rule
  must be covered by ``spec.tls`` (else ``HostWithoutTLS``), and wildcard hosts are refused;
* the served hosts are the rules' hosts and the ``spec.tls`` hosts, in that order, each once; at
  most :data:`HOSTS_MAX` per expose, so they are split over up to :data:`EXPOSES_MAX` http exposes
  sharing the port (``https-0``, ``https-1``, ...): at most :data:`MAX_HOSTS` in all;
* a host's paths are its rules' paths, then those of the rules without a host (which apply to
  every host; on a tie the host's own rule, listed first, wins). ``Exact`` and ``Prefix`` as the
  Ingress defines them; ``ImplementationSpecific`` is served as ``Prefix`` (an empty path as
  ``/``). At most :data:`PATHS_MAX` per host;
* a request no path matches goes to ``spec.defaultBackend``; without one, it gets 404;
* backends are Services of the Ingress's namespace, by port number or by a port name, which is
  resolved against the Service's ``spec.ports`` (a Service that does not exist or has no port of
  that name is ``BackendPortNotFound``); ``resource`` backends are refused (``ResourceBackend``).

The annotations ``tailnet.dev/hostname`` and ``tailnet.dev/tag`` are the LoadBalancer class's
(:mod:`.loadbalancer`), with the same defaults and the same tenancy. The TailnetIngress shape is
named ``<ingress>-ing`` (:data:`NAME_SUFFIX`), apart from a Service's ``<service>-lb``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailnet_operator.api.ingress import EXPOSES_MAX, HOSTS_MAX, PATHS_MAX, TailnetIngress
from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL

from .loadbalancer import AnnotatedObject, annotated_view, load_balancer_status, name_problem

__all__ = [
    "CONTROLLER",
    "DEFAULT_CLASS_ANNOTATION",
    "HTTPS_PORT",
    "MAX_HOSTS",
    "NAME_SUFFIX",
    "IngressObject",
    "PortOf",
    "Problem",
    "as_ingress",
    "class_of",
    "ingress_status",
    "object_name_of",
    "ports_of",
    "record_metadata",
    "record_name",
    "sweep_view",
    "tailnet_of",
    "tailnet_of_class",
]

CONTROLLER = "tailnet.dev/ingress-controller"
"""``spec.controller`` of a tailnet IngressClass."""
DEFAULT_CLASS_ANNOTATION = "ingressclass.kubernetes.io/is-default-class"
HTTPS_PORT = 443
MAX_HOSTS = EXPOSES_MAX * HOSTS_MAX
NAME_SUFFIX = "-ing"
"""Appended to the Ingress's name for the TailnetIngress shape, and so for every object it owns."""
INGRESS_NAMESPACE_LABEL = "tailnet.dev/networking-ingress-namespace"
INGRESS_NAME_LABEL = "tailnet.dev/networking-ingress-name"
_PARAMETERS = ("tailnet.dev", "Tailnet")


# -- the class ------------------------------------------------------------------------------------


def tailnet_of_class(ingress_class: Mapping[str, Any] | None) -> str | None:
    """The Tailnet a tailnet IngressClass names; None for another controller's class or one whose
    parameters do not name a Tailnet (cluster scope)."""
    spec = (ingress_class or {}).get("spec") or {}
    params = spec.get("parameters") or {}
    if spec.get("controller") != CONTROLLER or (params.get("apiGroup"), params.get("kind")) != _PARAMETERS:
        return None
    if params.get("scope", "Cluster") != "Cluster" or not params.get("name"):
        return None
    return str(params["name"])


def _is_default(ingress_class: Mapping[str, Any]) -> bool:
    notes = (ingress_class.get("metadata") or {}).get("annotations") or {}
    return notes.get(DEFAULT_CLASS_ANNOTATION) == "true"


def class_of(ingress: Mapping[str, Any], classes: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The IngressClass of ``controller: tailnet.dev/ingress-controller`` an Ingress (as stored)
    uses: the one ``spec.ingressClassName`` names, or for an Ingress without a class the cluster's
    default class when there is exactly one and it is a tailnet class. None otherwise."""
    name = (ingress.get("spec") or {}).get("ingressClassName")
    classes = list(classes)
    if name:
        found = [c for c in classes if (c.get("metadata") or {}).get("name") == name]
    else:
        found = [c for c in classes if _is_default(c)]
        found = found if len(found) == 1 else []
    return found[0] if found and (found[0].get("spec") or {}).get("controller") == CONTROLLER else None


def tailnet_of(ingress: Mapping[str, Any], classes: Iterable[Mapping[str, Any]]) -> str | None:
    """The Tailnet an Ingress asks for through its class; None for every other Ingress."""
    return tailnet_of_class(class_of(ingress, classes))


# -- the Ingress as parsed ------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _PortRef(_Model):
    name: str | None = None
    number: int | None = None


class _ServiceRef(_Model):
    name: str
    port: _PortRef = Field(default_factory=_PortRef)


class _ResourceRef(_Model):
    kind: str = ""
    name: str = ""


class IngressBackend(_Model):
    service: _ServiceRef | None = None
    resource: _ResourceRef | None = None


class IngressPath(_Model):
    path: str | None = None
    path_type: str = Field(default="ImplementationSpecific", alias="pathType")
    backend: IngressBackend


class _RuleHTTP(_Model):
    paths: list[IngressPath] = Field(default_factory=list)


class IngressRule(_Model):
    host: str | None = None
    http: _RuleHTTP | None = None


class IngressTLS(_Model):
    hosts: list[str] = Field(default_factory=list)
    secret_name: str | None = Field(default=None, alias="secretName")


class _IngressSpec(_Model):
    ingress_class_name: str | None = Field(default=None, alias="ingressClassName")
    default_backend: IngressBackend | None = Field(default=None, alias="defaultBackend")
    tls: list[IngressTLS] = Field(default_factory=list)
    rules: list[IngressRule] = Field(default_factory=list)


class IngressObject(AnnotatedObject):
    """An Ingress as the IngressClass reads it: its annotations (those of the LoadBalancer
    class), rules, TLS and default backend. Which Tailnet it asks for is its class's to say
    (:func:`tailnet_of`)."""

    spec: _IngressSpec = Field(default_factory=_IngressSpec)


PortOf = Callable[[str, str], int | None]
"""The number of a Service's port by its name (Service name, port name); None when the Service
does not exist or has no such port."""


def ports_of(service: Callable[[str], Mapping[str, Any] | None]) -> PortOf:
    """:data:`PortOf` over ``service``, which gives a Service of the Ingress's namespace (as stored) by name."""
    def port(name: str, port_name: str) -> int | None:
        spec = (service(name) or {}).get("spec") or {}
        return next((int(p["port"]) for p in spec.get("ports") or [] if p.get("name") == port_name and p.get("port")),
                    None)

    return port


class Problem(Exception):
    """What keeps an Ingress from being served: a CamelCase reason and a message that says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.reason, self.message = reason, message


def object_name_of(ingress_name: str) -> str:
    """The name of the TailnetIngress shape, the stem of every object the Ingress owns."""
    return f"{ingress_name}{NAME_SUFFIX}"




def _backend(backend: IngressBackend, where: str, ingress: IngressObject, port_of: PortOf) -> dict[str, Any]:
    if backend.service is None:
        what = f"{backend.resource.kind}/{backend.resource.name}" if backend.resource else "no Service"
        raise Problem("ResourceBackend", (
            f"{where} names a resource backend ({what}); the tailnet node forwards to Services only: "
            "give it a service backend"))
    service, port = backend.service.name, backend.service.port
    if port.number:
        return {"service": service, "port": port.number}
    number = port_of(service, port.name or "") if port.name else None
    if number is None:
        raise Problem("BackendPortNotFound", (
            f"{where} names port {port.name!r} of Service {service}, which "
            f"{'has no port of that name' if port.name else 'is not given'} or does not exist in namespace "
            f"{ingress.namespace}: name a port the Service has, or give its number"))
    return {"service": service, "port": number}


def _path(path: IngressPath, where: str, ingress: IngressObject, port_of: PortOf) -> dict[str, Any]:
    """An Ingress path as a TailnetIngress host path: ImplementationSpecific served as Prefix."""
    kind = "Exact" if path.path_type == "Exact" else "Prefix"
    return {"path": path.path or "/", "pathType": kind,
            "backend": _backend(path.backend, f"{where}.backend", ingress, port_of)}


def _secrets(ingress: IngressObject, rule_hosts: list[str]) -> dict[str, str]:
    """Each TLS host's Secret: the first entry that lists it; an entry without hosts covers the rule
    hosts no entry lists."""
    secrets: dict[str, str] = {}
    for i, tls in enumerate(ingress.spec.tls):
        if not tls.secret_name:
            raise Problem("TLSWithoutSecret", (
                f"spec.tls[{i}] names no secretName; the tailnet node terminates TLS itself and needs a "
                "kubernetes.io/tls Secret for its hosts"))
        for host in tls.hosts:
            secrets.setdefault(host.lower(), tls.secret_name)
    for tls in ingress.spec.tls:
        if not tls.hosts and tls.secret_name:
            for host in rule_hosts:
                secrets.setdefault(host, tls.secret_name)
    return secrets


def _hosts(ingress: IngressObject, port_of: PortOf) -> list[dict[str, Any]]:
    """The served hosts, each with its TLS Secret and paths."""
    own: dict[str, list[dict[str, Any]]] = {}
    common: list[dict[str, Any]] = []
    for i, rule in enumerate(ingress.spec.rules):
        paths = [_path(p, f"spec.rules[{i}].http.paths[{j}]", ingress, port_of)
                 for j, p in enumerate(rule.http.paths if rule.http else [])]
        if rule.host:
            own.setdefault(rule.host.lower(), []).extend(paths)
        else:
            common.extend(paths)
    secrets = _secrets(ingress, list(own))
    names = list(dict.fromkeys([*own, *secrets]))
    if wild := [n for n in names if "*" in n]:
        raise Problem("WildcardHost", (
            f"{', '.join(wild)}: the tailnet node picks a host by its exact name (SNI), so wildcard hosts "
            "cannot be served; list each name"))
    if bare := [n for n in own if n not in secrets]:
        raise Problem("HostWithoutTLS", (
            f"{', '.join(bare)} {'is' if len(bare) == 1 else 'are'} in no spec.tls entry: the tailnet node serves "
            "HTTPS only, with each host's certificate; add the host to spec.tls with a kubernetes.io/tls Secret"))
    if not names:
        raise Problem("NoTLSHost", (
            "the Ingress names no host in spec.tls: the tailnet node serves HTTPS by SNI and needs at least one "
            "host with a kubernetes.io/tls Secret"))
    if len(names) > MAX_HOSTS:
        raise Problem("TooManyHosts", (
            f"the Ingress has {len(names)} hosts; a tailnet node serves at most {MAX_HOSTS}: split it into "
            f"Ingresses of at most {MAX_HOSTS} hosts"))
    unmatched = "Backend" if ingress.spec.default_backend is not None else "NotFound"
    hosts = []
    for name in names:
        paths = [*own.get(name, []), *common]
        if len(paths) > PATHS_MAX:
            raise Problem("TooManyPaths", (
                f"host {name} has {len(paths)} paths (its rules' and those of the rules without a host); a host "
                f"serves at most {PATHS_MAX}"))
        host: dict[str, Any] = {"name": name, "tls": {"secretName": secrets[name]}}
        if paths:
            host |= {"paths": paths, "unmatchedPaths": unmatched}
        hosts.append(host)
    return hosts


def as_ingress(ingress: IngressObject, tailnet: str, port_of: PortOf) -> TailnetIngress:
    """The TailnetIngress the Ingress is served as on the Tailnet ``tailnet``; raises :class:`Problem`
    for what cannot be served (the module docstring lists the rules)."""
    if (found := name_problem("Ingress", ingress.name, NAME_SUFFIX)) is not None:
        raise Problem(*found)
    hosts = _hosts(ingress, port_of)
    if ingress.spec.default_backend is not None:
        backend = _backend(ingress.spec.default_backend, "spec.defaultBackend", ingress, port_of)
    elif first := next((p["backend"] for h in hosts for p in h.get("paths", [])), None):
        backend = first  # never asked: every host has paths and no fallback (404)
    else:
        raise Problem("NoBackend", "the Ingress has neither a path nor a defaultBackend: there is nothing to serve")
    exposes = [{"name": f"https-{k // HOSTS_MAX}", "mode": "http", "port": HTTPS_PORT, "backend": backend,
                "hosts": hosts[k:k + HOSTS_MAX]} for k in range(0, len(hosts), HOSTS_MAX)]
    try:
        return TailnetIngress.model_validate({
            "metadata": {"name": object_name_of(ingress.name), "namespace": ingress.namespace,
                         "uid": ingress.metadata.uid},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": ingress.tag, "hostname": ingress.hostname,
                     "exposes": exposes}})
    except ValidationError as exc:
        first_error = exc.errors()[0]
        where = ".".join(str(p) for p in first_error["loc"])
        raise Problem("Unservable", f"the Ingress cannot be served as a tailnet node: {where}: {first_error['msg']}") \
            from None


# -- the key record and the status ---------------------------------------------------------------


def record_name(namespace: str, name: str) -> str:
    """The Ingress's pre-auth key record in the operator's namespace (apart from a TailnetIngress's
    ``ingress.<namespace>.<name>`` and a Service's ``loadbalancer.<namespace>.<name>``)."""
    return f"ingressclass.{namespace}.{name}"


def record_metadata(ingress: IngressObject, tailnet: str, operator_namespace: str) -> dict[str, Any]:
    """metadata of the record: no owner (it lives in another namespace; the operator deletes it)."""
    return {"name": record_name(ingress.namespace, ingress.name), "namespace": operator_namespace,
            "labels": {**MANAGED_BY, TAILNET_LABEL: tailnet, INGRESS_NAMESPACE_LABEL: ingress.namespace,
                       INGRESS_NAME_LABEL: ingress.name}}


def ingress_status(node: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.loadBalancer`` of the Ingress: the LoadBalancer class's entries (the MagicDNS name as
    ``hostname``, each tailnet address as ``ip``) without ``ipMode``, which an Ingress's status has not."""
    entries = load_balancer_status(node).get("ingress") or []
    return {"ingress": [{k: v for k, v in e.items() if k != "ipMode"} for e in entries]} if entries else {}


def sweep_view(ingress: Mapping[str, Any], tailnet: str, classes: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """An Ingress of ``tailnet``'s class as the orphan sweep counts a CR (its metadata and
    ``spec.tag``), so that its key and node are never taken for orphans; None for any other."""
    return annotated_view(ingress) if tailnet_of(ingress, classes) == tailnet else None
