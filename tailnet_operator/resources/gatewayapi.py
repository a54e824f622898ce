"""A Gateway API ``Gateway`` (gateway.networking.k8s.io/v1) of a tailnet GatewayClass and the
``HTTPRoute``s, ``TLSRoute``s and ``TCPRoute``s attached to it, translated into the TailnetIngress
the Gateway is served as, with what each listener and each route's parent status must say: desired
state in, models out.

The class: a GatewayClass whose ``spec.controllerName`` is :data:`CONTROLLER` and whose
``spec.parametersRef`` names a Tailnet (``group: tailnet.dev``, ``kind: Tailnet``, ``name``).

Such a Gateway becomes one tailnet node, as a TailnetIngress (:func:`as_ingress`):

* its ``HTTPS`` listeners (``tls.mode: Terminate``) are served, those of one port as the http
  exposes of that port, each listener's certificate the Secret of its first ``certificateRefs``
  entry (a Secret of the Gateway's namespace); its ``HTTP`` listeners as plaintext http exposes
  (the tailnet's WireGuard is the encryption). Its ``TLS`` listeners (``tls.mode: Passthrough``)
  serve TLSRoutes as tls exposes: the node reads SNI from the ClientHello and passes the
  connection, still encrypted, to the Service of the oldest route that asks for that name, one
  expose per route. Its ``TCP`` listeners serve TCPRoutes as tcp exposes: a port takes one listener
  (else ``HostnameConflict``) and its oldest route. The listeners of one port share a protocol
  (else ``ProtocolConflict``). Other protocols (UDP) are ``Accepted: False`` with
  ``UnsupportedProtocol``, and the others go on;
* a GRPCRoute attaches to HTTPS listeners (HTTP/2 negotiated by ALPN) and HTTP listeners (HTTP/2
  with prior knowledge, h2c, which the node tells from HTTP/1.1 by its preface): a service and
  method match is the exact path ``/service/method``, a service alone the prefix ``/service/``;
  its hosts are exposes of their own whose backends are spoken to over HTTP/2. A hostname goes to
  the kind (HTTPRoute or GRPCRoute) of the oldest route that asks for it;
* a TLSRoute's or TCPRoute's connections go to one Service: several backends with weights above 0
  are ``UnsupportedValue``; one that does not resolve leaves its names or port unserved, so its
  connections are refused, as the specification asks. A Gateway whose listeners are all TLS or
  TCP with no route served yet is a node with no port open, Programmed with its addresses;
* the agent picks a host by its exact name (SNI), so the served hosts are exact names: a listener
  with an exact ``hostname`` serves that name; one with a wildcard (``*.example.com``) or none
  serves the exact hostnames of the routes attached to it that it covers. A route hostname that is
  a wildcard is not served (it shows in the route's ``Accepted`` message);
* a route attaches to a listener its ``parentRefs`` name (the Gateway, and ``sectionName`` and
  ``port`` when given) whose ``allowedRoutes`` admit the route's namespace (``Same``, the
  default, or ``All``; ``Selector`` is given the namespaces' labels) and whose hostname shares a
  name with the route's (no hostnames on either side matches any);
* each rule's matches become a host's paths, in the Gateway API's order among equals: the oldest
  route first, then by namespace and name, then rule and match order (the agent's precedence,
  longest path first, then method, headers and query, does the rest). ``PathPrefix`` is
  ``Prefix``; ``RegularExpression`` matches are refused (``UnsupportedValue``). The filters
  ``RequestHeaderModifier``, ``ResponseHeaderModifier``, ``RequestRedirect`` and ``URLRewrite``
  are served; any other refuses the route (``UnsupportedValue``);
* a route of another namespace than the Gateway's attaches only when the Tailnet's tenancy lets
  its namespace use the Gateway's tag (:func:`tailnet_operator.tenancy.shares_tag`): its Services
  go on the tailnet under that tag;
* backends are Services, by ``port``, with their weights: of the route's namespace, or of another
  one whose ReferenceGrant lets the route's namespace refer to them (else ``RefNotPermitted``);
  another kind is ``InvalidKind``, a Service that does not exist is ``BackendNotFound``. A rule whose backends
  all fail, or that has none and no redirect, is served with weight 0 (500), as the
  specification says;
* a request no path of its host matches gets 404.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tailnet_operator.api.common import ANY_HOST
from tailnet_operator.api.ingress import EXPOSES_MAX, HOSTS_MAX, PATHS_MAX, HostPath, TailnetIngress
from tailnet_operator.names import MANAGED_BY, TAILNET_LABEL

from . import owned_metadata
from .loadbalancer import AnnotatedObject, annotated_view, shape_name

__all__ = [
    "CONTROLLER",
    "GROUP",
    "ROUTE_KINDS",
    "SUPPORTED_FEATURES",
    "GatewayObject",
    "GatewayPlan",
    "ListenerResult",
    "ParentResult",
    "RouteKey",
    "RouteObject",
    "ServedGateway",
    "as_ingress",
    "certificate_copy",
    "certificate_copy_name",
    "certificate_problem",
    "certificate_secrets",
    "class_conditions",
    "cross_namespace_certificates",
    "dial_port",
    "gateway_status",
    "hostnames_intersect",
    "names_gateway",
    "object_name_of",
    "record_metadata",
    "record_name",
    "reference_granted",
    "route_parents",
    "sweep_view",
    "tailnet_of",
    "tailnet_of_class",
]

CONTROLLER = "tailnet.dev/gateway-controller"
"""``spec.controllerName`` of a tailnet GatewayClass."""
GROUP = "gateway.networking.k8s.io"
NAME_SUFFIX = "-gw"
"""Appended to the Gateway's name for the TailnetIngress shape (apart from an Ingress's ``-ing``)."""
_PARAMETERS = ("tailnet.dev", "Tailnet")
_PATH_TYPES = {"PathPrefix": "Prefix", "Exact": "Exact"}
ROUTE_KINDS = {"HTTP": ("HTTPRoute", "GRPCRoute"), "HTTPS": ("HTTPRoute", "GRPCRoute"), "TLS": ("TLSRoute",),
               "TCP": ("TCPRoute",)}
"""The route kinds each served listener protocol takes. gRPC needs HTTP/2, which the node serves
over TLS (ALPN ``h2``) and in plaintext (prior knowledge, h2c): GRPCRoutes attach to HTTP and
HTTPS listeners."""
_FILTERS = {"RequestHeaderModifier": ("requestHeaderModifier", "requestHeaders"),
            "ResponseHeaderModifier": ("responseHeaderModifier", "responseHeaders"),
            "RequestRedirect": ("requestRedirect", "redirect"), "URLRewrite": ("urlRewrite", "rewrite")}
"""The filters served: their field in the HTTPRoute, and the TailnetIngress path's field."""


def tailnet_of_class(gateway_class: Mapping[str, Any] | None) -> str | None:
    """The Tailnet a tailnet GatewayClass names; None for another controller's class or one whose
    ``parametersRef`` does not name a Tailnet."""
    spec = (gateway_class or {}).get("spec") or {}
    params = spec.get("parametersRef") or {}
    if spec.get("controllerName") != CONTROLLER or (params.get("group"), params.get("kind")) != _PARAMETERS:
        return None
    return str(params["name"]) if params.get("name") else None


def tailnet_of(gateway: Mapping[str, Any], classes: Iterable[Mapping[str, Any]]) -> str | None:
    """The Tailnet a Gateway asks for through its ``gatewayClassName``; None for every other Gateway."""
    name = (gateway.get("spec") or {}).get("gatewayClassName")
    found = next((c for c in classes if (c.get("metadata") or {}).get("name") == name), None)
    return tailnet_of_class(found) if name else None


def certificate_problem(secret: Mapping[str, Any] | None) -> str | None:
    """Why a Secret (as stored) cannot be a listener's certificate: missing, without ``tls.crt``
    and ``tls.key``, not PEM, or a key that is not the certificate's; None when it can."""
    if secret is None:
        return "not found"
    data = secret.get("data") or {}
    return _pem_problem(str(data.get("tls.crt") or ""), str(data.get("tls.key") or ""))


@functools.lru_cache(maxsize=256)
def _pem_problem(chain_b64: str, key_b64: str) -> str | None:
    """:func:`certificate_problem` of the Secret's two fields, parsed once per content: every plan
    of a Gateway (each reconcile, and the policy's pass over the Tailnet's Gateways) asks again."""
    try:
        chain, key = (base64.b64decode(v, validate=True) for v in (chain_b64, key_b64))
    except binascii.Error:
        return "tls.crt or tls.key is not base64"
    if not chain or not key:
        return "no tls.crt and tls.key (a kubernetes.io/tls Secret is needed)"
    try:
        certificate = x509.load_pem_x509_certificate(chain)
    except ValueError:
        return "tls.crt is not a PEM certificate"
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return "tls.key is not an unencrypted PEM private key"
    if private.public_key().public_bytes(*_SPKI) != certificate.public_key().public_bytes(*_SPKI):
        return "tls.key is not the key of the certificate in tls.crt"
    return None


_SPKI = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def certificate_secrets(gateway: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The Secrets (namespace, name) a Gateway's listeners name as certificates, as stored (no
    validation: a mapper reads it)."""
    namespace = (gateway.get("metadata") or {}).get("namespace") or ""
    return {(ref.get("namespace") or namespace, ref["name"])
            for listener in (gateway.get("spec") or {}).get("listeners") or []
            for ref in ((listener.get("tls") or {}).get("certificateRefs") or [])
            if (ref.get("group") or "", ref.get("kind") or "Secret") == ("", "Secret") and ref.get("name")}


SUPPORTED_FEATURES = ("GRPCRoute", "Gateway", "HTTPRoute", "HTTPRouteHostRewrite", "HTTPRouteMethodMatching",
                      "HTTPRoutePathRedirect", "HTTPRoutePathRewrite", "HTTPRoutePortRedirect",
                      "HTTPRouteQueryParamMatching", "HTTPRouteResponseHeaderModification",
                      "HTTPRouteSchemeRedirect", "ReferenceGrant", "TCPRoute", "TLSRoute")
"""``status.supportedFeatures`` of a tailnet GatewayClass (sorted, as the specification asks): the
conformance features the translation and the agent serve. GRPCRoute: the conformance suite calls
gRPC on HTTP listeners, in plaintext with prior knowledge (h2c), which the agent's plaintext ports
serve beside HTTP/1.1 (and HTTPS listeners over ALPN ``h2``)."""


def class_conditions(gateway_class: Mapping[str, Any], tailnet_exists: Callable[[str], bool]) -> list[Condition]:
    """``Accepted`` of a GatewayClass of :data:`CONTROLLER`: True when its ``parametersRef`` names a
    Tailnet that exists, else ``InvalidParameters`` with what to change."""
    params = ((gateway_class.get("spec") or {}).get("parametersRef") or {})
    name = tailnet_of_class(gateway_class)
    if name is None:
        return [Condition("Accepted", False, "InvalidParameters", (
            f"parametersRef names {params.get('group') or 'core'}/{params.get('kind') or '?'} "
            f"{params.get('name') or '?'}; a tailnet GatewayClass names a Tailnet "
            "(group: tailnet.dev, kind: Tailnet, name)"))]
    if not tailnet_exists(name):
        return [Condition("Accepted", False, "InvalidParameters", f"the Tailnet {name} does not exist")]
    return [Condition("Accepted", True, "Accepted", f"Gateways of this class become nodes of the Tailnet {name}")]


# -- the objects as parsed ------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Meta(_Model):
    name: str
    namespace: str = "default"
    uid: str = ""
    creation_timestamp: str = Field(default="", alias="creationTimestamp")
    generation: int = 0
    annotations: dict[str, str] = Field(default_factory=dict)


class _SecretRef(_Model):
    group: str = ""
    kind: str = "Secret"
    name: str
    namespace: str | None = None


class _TLS(_Model):
    mode: str = "Terminate"
    certificate_refs: list[_SecretRef] = Field(default_factory=list, alias="certificateRefs")


class _Namespaces(_Model):
    from_: str = Field(default="Same", alias="from")
    selector: dict[str, Any] | None = None


class _AllowedRoutes(_Model):
    namespaces: _Namespaces = Field(default_factory=_Namespaces)
    kinds: list[dict[str, str]] = Field(default_factory=list)


class Listener(_Model):
    name: str
    hostname: str | None = None
    port: int
    protocol: str
    tls: _TLS | None = None
    allowed_routes: _AllowedRoutes = Field(default_factory=_AllowedRoutes, alias="allowedRoutes")


class _GatewaySpec(_Model):
    gateway_class_name: str = Field(alias="gatewayClassName")
    listeners: list[Listener] = Field(default_factory=list)


class GatewayObject(_Model):
    """A Gateway as its translation reads it."""

    metadata: _Meta
    spec: _GatewaySpec

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


class ParentRef(_Model):
    group: str = GROUP
    kind: str = "Gateway"
    namespace: str | None = None
    name: str
    section_name: str | None = Field(default=None, alias="sectionName")
    port: int | None = None

    def to_json(self, route_namespace: str) -> dict[str, Any]:
        """The reference as the route's status repeats it (the namespace filled in)."""
        out: dict[str, Any] = {"group": self.group, "kind": self.kind, "namespace": self.namespace or route_namespace,
                               "name": self.name}
        if self.section_name:
            out["sectionName"] = self.section_name
        if self.port:
            out["port"] = self.port
        return out


class _Match(_Model):
    type: str = "Exact"
    name: str
    value: str


class _PathMatch(_Model):
    type: str = "PathPrefix"
    value: str = "/"


class _GrpcMethod(_Model):
    type: str = "Exact"
    service: str | None = None
    method: str | None = None


class RouteMatch(_Model):
    path: _PathMatch = Field(default_factory=_PathMatch)
    headers: list[_Match] = Field(default_factory=list)
    query_params: list[_Match] = Field(default_factory=list, alias="queryParams")
    method: str | _GrpcMethod | None = None
    """An HTTP method (HTTPRoute), or a gRPC service and method (GRPCRoute)."""


class BackendRef(_Model):
    group: str = ""
    kind: str = "Service"
    name: str
    namespace: str | None = None
    port: int | None = None
    weight: int = 1


class RouteRule(_Model):
    matches: list[RouteMatch] = Field(default_factory=lambda: [RouteMatch()])
    filters: list[dict[str, Any]] = Field(default_factory=list)
    backend_refs: list[BackendRef] = Field(default_factory=list, alias="backendRefs")


class _RouteSpec(_Model):
    parent_refs: list[ParentRef] = Field(default_factory=list, alias="parentRefs")
    hostnames: list[str] = Field(default_factory=list)
    rules: list[RouteRule] = Field(default_factory=lambda: [RouteRule()])


RouteKey = tuple[str, str, str]
"""A route's kind, namespace and name."""


class RouteObject(_Model):
    """An HTTPRoute, TLSRoute or TCPRoute as its translation reads it (``kind`` as stored; a
    TCPRoute has no hostnames and its rule no matches or filters, so their defaults apply)."""

    kind: str = "HTTPRoute"
    metadata: _Meta
    spec: _RouteSpec = Field(default_factory=_RouteSpec)

    @property
    def key(self) -> RouteKey:
        return self.kind, self.metadata.namespace, self.metadata.name

    @property
    def streams(self) -> bool:
        """Whether the route carries connections (TLSRoute, TCPRoute) rather than requests."""
        return self.kind in ("TLSRoute", "TCPRoute")


class ServedGateway(AnnotatedObject):
    """A Gateway as the controller serves it: the LoadBalancer class's annotations
    (``tailnet.dev/hostname``, ``tailnet.dev/tag``, validated, with their defaults) and its spec."""

    spec: _GatewaySpec

    @property
    def gateway(self) -> GatewayObject:
        """The Gateway as its translation reads it."""
        meta = self.metadata
        return GatewayObject(metadata=_Meta(name=self.name, namespace=self.namespace, uid=meta.uid or "",
                                            generation=meta.generation or 0), spec=self.spec)


def names_gateway(route: Mapping[str, Any], gateway: Mapping[str, Any]) -> bool:
    """Whether an HTTPRoute (as stored) has a ``parentRefs`` entry naming the Gateway (as stored)."""
    route_ns = (route.get("metadata") or {}).get("namespace")
    meta = gateway.get("metadata") or {}
    return any((ref.get("group", GROUP), ref.get("kind", "Gateway"), ref.get("name"), ref.get("namespace") or route_ns)
               == (GROUP, "Gateway", meta.get("name"), meta.get("namespace"))
               for ref in (route.get("spec") or {}).get("parentRefs") or [])


def object_name_of(gateway_name: str) -> str:
    """The name of the TailnetIngress shape, the stem of every object the Gateway owns: the
    Gateway's name and ``-gw``, cut with a digest when too long (:func:`.loadbalancer.shape_name`;
    the conformance suite names Gateways of 47 characters)."""
    return shape_name(gateway_name, NAME_SUFFIX)


def certificate_copy_name(gateway_name: str, namespace: str, name: str) -> str:
    """The Secret in the Gateway's namespace that holds a copy of the certificate Secret
    ``namespace/name`` a ReferenceGrant lets the Gateway use (a pod mounts Secrets of its own
    namespace only): the shape's name, ``-cert-`` and a digest of where it comes from."""
    digest = hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:10]
    return f"{object_name_of(gateway_name)}-cert-{digest}"


def certificate_copy(owner: Mapping[str, Any], tailnet: str, namespace: str, source: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """The copy (:func:`certificate_copy_name`) of ``source``, a certificate Secret of
    ``namespace``: its ``tls.crt`` and ``tls.key`` only, owned by the Gateway."""
    meta = owner["metadata"]
    data = source.get("data") or {}
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": owned_metadata(dict(owner), name=certificate_copy_name(meta["name"], namespace,
                                                                               source["metadata"]["name"]),
                                       namespace=meta["namespace"], tailnet=tailnet),
            "data": {k: data[k] for k in ("tls.crt", "tls.key")}}


def cross_namespace_certificates(gateway: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The certificate Secrets (namespace, name) of another namespace a Gateway (as stored) names."""
    own = (gateway.get("metadata") or {}).get("namespace") or ""
    return sorted(ref for ref in certificate_secrets(gateway) if ref[0] != own)




def gateway_name_problem(name: str) -> tuple[str, str] | None:
    """None: a Gateway of any name is served (its shape's name is cut, :func:`object_name_of`)."""
    return None


def record_name(namespace: str, name: str) -> str:
    """The Gateway's pre-auth key record in the operator's namespace (apart from an Ingress's
    ``ingressclass.<namespace>.<name>`` and a Service's ``loadbalancer.<namespace>.<name>``)."""
    return f"gatewayapi.{namespace}.{name}"


GATEWAY_NAMESPACE_LABEL = "tailnet.dev/gateway-api-namespace"
GATEWAY_NAME_LABEL = "tailnet.dev/gateway-api-name"


def record_metadata(gateway: ServedGateway, tailnet: str, operator_namespace: str) -> dict[str, Any]:
    """metadata of the record: no owner (it lives in another namespace; the operator deletes it)."""
    return {"name": record_name(gateway.namespace, gateway.name), "namespace": operator_namespace,
            "labels": {**MANAGED_BY, TAILNET_LABEL: tailnet, GATEWAY_NAMESPACE_LABEL: gateway.namespace,
                       GATEWAY_NAME_LABEL: gateway.name}}


def sweep_view(gateway: Mapping[str, Any], tailnet: str, classes: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """A Gateway of ``tailnet``'s class as the orphan sweep counts a CR (its metadata and
    ``spec.tag``), so that its key and node are never taken for orphans; None for any other."""
    return annotated_view(gateway) if tailnet_of(gateway, classes) == tailnet else None


# -- what the translation says --------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str


@dataclass
class ListenerResult:
    """A listener's status: the routes attached, its conditions and the route kinds it takes."""

    name: str
    attached_routes: int = 0
    conditions: list[Condition] = field(default_factory=list)
    supported_kinds: list[dict[str, str]] = field(default_factory=lambda: [{"group": GROUP, "kind": "HTTPRoute"}])


@dataclass
class ParentResult:
    """One ``parentRefs`` entry of a route that names this Gateway: its conditions."""

    parent: dict[str, Any]
    accepted: Condition
    resolved_refs: Condition


@dataclass
class GatewayPlan:
    """The TailnetIngress shape of a Gateway (None when nothing can be served), with the status of
    its listeners and of the routes that name it."""

    ingress: TailnetIngress | None
    accepted: Condition
    listeners: list[ListenerResult]
    parents: dict[RouteKey, list[ParentResult]]

    @property
    def unresolved(self) -> bool:
        """Whether a listener waits for an object it names (its certificate's Secret): the plan can
        change with no change to the Gateway."""
        return any(c.type == "ResolvedRefs" and not c.status for ls in self.listeners for c in ls.conditions)


ServiceLookup = Callable[[str, str], Mapping[str, Any] | None]
"""A Service (namespace, name) as stored; None when it does not exist."""


_NO_PORT: dict[str, Any] = {"name": "no-port", "port": 1, "backend": {"service": "no-port", "port": 1}}
"""The expose a Gateway with no port to open is checked with (the schema wants one), then dropped."""


def dial_port(service: Mapping[str, Any], port: int) -> int | str:
    """The port the node dials for ``port`` of ``service``: that port through the Service's
    virtual IP; for a headless Service (``clusterIP: None``, whose name resolves to its endpoints)
    the port's ``targetPort``. A string says why it cannot be dialled."""
    spec = service.get("spec") or {}
    if spec.get("clusterIP") != "None":
        return port
    entry = next((p for p in spec.get("ports") or [] if p.get("port") == port), None)
    if entry is None:
        return f"the headless Service has no port {port}"
    target = entry.get("targetPort", port)
    if not isinstance(target, int):
        return (f"the headless Service's port {port} names its targetPort {target!r}, which may differ from "
                "endpoint to endpoint; give it a number")
    return target
NamespaceLabels = Callable[[str], Mapping[str, str] | None]
"""A namespace's labels; None when the namespace is not known."""
CertificateProblem = Callable[[str, str], str | None]
"""What is wrong with a certificate Secret (namespace, name) for a listener: None when it holds a
PEM certificate and its key (:func:`certificate_problem`), else why not ("not found", ...)."""
SharesTag = Callable[[str], bool]
"""Whether the Tailnet's tenancy lets a namespace put its Services behind the Gateway's node
(:func:`tailnet_operator.tenancy.shares_tag`)."""
Granted = Callable[[str, str, str, str, str], bool]
"""Whether a ReferenceGrant lets objects of a kind (``HTTPRoute``, ``Gateway``) of a namespace
refer to an object (kind, namespace, name): ``granted(from_kind, from_ns, to_kind, to_ns, to_name)``."""


def reference_granted(grants: Iterable[Mapping[str, Any]], from_kind: str, from_namespace: str, to_kind: str,
                      to_namespace: str, to_name: str) -> bool:
    """Whether one of ``grants`` (ReferenceGrants as stored) in ``to_namespace`` lets objects of
    ``from_kind`` (of the Gateway API's group) in ``from_namespace`` refer to the core object
    ``to_kind`` ``to_name`` (a grant's ``to`` without a name covers every object of the kind)."""
    for grant in grants:
        if (grant.get("metadata") or {}).get("namespace") != to_namespace:
            continue
        spec = grant.get("spec") or {}
        if not any((f.get("group"), f.get("kind"), f.get("namespace")) == (GROUP, from_kind, from_namespace)
                   for f in spec.get("from") or []):
            continue
        if any((t.get("group") or "", t.get("kind")) == ("", to_kind) and t.get("name") in (None, "", to_name)
               for t in spec.get("to") or []):
            return True
    return False


def _nobody(_: str) -> bool:
    return False


def _nothing(*_: str) -> bool:
    return False


# -- hostnames ------------------------------------------------------------------------------------


def _covers(pattern: str, name: str) -> bool:
    """Whether the hostname ``pattern`` (exact, or ``*.`` and a suffix: one or more labels) covers
    the exact ``name``."""
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return pattern == name


def hostnames_intersect(listener: str | None, route: Iterable[str]) -> bool:
    """Whether a route with ``route`` hostnames may attach to a listener of ``listener``: no
    hostname on either side matches any; else some pair covers one another."""
    names = [n.lower() for n in route]
    if not listener or not names:
        return True
    listener = listener.lower()
    return any(_covers(listener, n) or _covers(n, listener) for n in names)


def _served_names(listener: Listener, routes: list[RouteObject]) -> list[str]:
    """The hosts a listener serves for ``routes``: its own exact hostname; else each route hostname
    where the two intersect, the narrower of the two (``*.a.example`` of a listener
    ``*.example`` and a route ``*.a.example``); a route without hostnames is served as the
    listener's own hostname, or :data:`~tailnet_operator.api.common.ANY_HOST` without one. The
    agent answers a name with the closest host of the port: exact, then the longest ``*.`` name,
    then ``*``."""
    own = (listener.hostname or "").lower()
    if own and not own.startswith("*."):
        return [own]
    names = []
    for route in routes:
        for name in (h.lower() for h in route.spec.hostnames):
            if not own or _covers(own, name):
                names.append(name)
            elif _covers(name, own):
                names.append(own)
        if not route.spec.hostnames:
            names.append(own or ANY_HOST)
    return list(dict.fromkeys(names))


# -- attachment ----------------------------------------------------------------------------------


def _names_gateway(ref: ParentRef, route: RouteObject, gateway: GatewayObject) -> bool:
    return (ref.group, ref.kind, ref.name, ref.namespace or route.metadata.namespace) == \
        (GROUP, "Gateway", gateway.name, gateway.namespace)


def _route_kinds(listener: Listener) -> tuple[list[dict[str, str]], list[str]]:
    """The route kinds a listener takes of those its ``allowedRoutes.kinds`` name (its protocol's
    kinds, :data:`ROUTE_KINDS`, when it names none), and the names of those not served."""
    kinds = ROUTE_KINDS.get(listener.protocol, ())
    named = listener.allowed_routes.kinds or [{"group": GROUP, "kind": k} for k in kinds]
    served = [k for k in named if k.get("group", GROUP) == GROUP and k.get("kind") in kinds]
    return list({str(k["kind"]): {"group": GROUP, "kind": str(k["kind"])} for k in served}.values()), \
        [str(k.get("kind")) for k in named if k not in served]


def _admits(listener: Listener, route: RouteObject, gateway: GatewayObject, labels: NamespaceLabels) -> bool:
    if route.kind not in [k["kind"] for k in _route_kinds(listener)[0]]:
        return False
    allowed = listener.allowed_routes.namespaces
    if allowed.from_ == "All":
        return True
    if allowed.from_ == "Selector":
        return _selects(allowed.selector or {}, labels(route.metadata.namespace) or {})
    return route.metadata.namespace == gateway.namespace


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (``matchLabels``, ``matchExpressions`` with In, NotIn, Exists, DoesNotExist)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and present and labels[key] in values) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def _condition(kind: str, ok: bool, reason: str, message: str) -> Condition:
    return Condition(kind, ok, reason, message)


@dataclass
class _Attachment:
    route: RouteObject
    listeners: list[Listener]


@dataclass
class _Attached:
    """What :func:`_attach` found: the routes to serve on which listeners, each route's parent
    entries, and each listener's attached routes as the specification counts them (by its
    ``allowedRoutes`` and the routes' ``parentRefs`` and hostnames alone: a listener that is not
    served, or a route that is not, still counts)."""

    attachments: list[_Attachment]
    parents: dict[RouteKey, list[ParentResult]]
    counts: dict[str, int]


def _attach(gateway: GatewayObject, routes: list[RouteObject], served: list[Listener],
            labels: NamespaceLabels, shares: SharesTag) -> _Attached:
    """Which served listeners each route attaches to, each of its parentRefs' Accepted condition
    (ResolvedRefs is filled in by the rules' translation), and each listener's count."""
    attachments: list[_Attachment] = []
    parents: dict[RouteKey, list[ParentResult]] = {}
    counts = {ls.name: 0 for ls in gateway.spec.listeners}
    for route in routes:
        attached: list[Listener] = []
        counted: set[str] = set()
        for ref in route.spec.parent_refs:
            if not _names_gateway(ref, route, gateway):
                continue
            accepted, matching, usable = _parent(ref, route, gateway, served, labels, shares)
            counted.update(ls.name for ls in matching)
            attached.extend(ls for ls in usable if ls not in attached)
            parents.setdefault(route.key, []).append(ParentResult(
                ref.to_json(route.metadata.namespace), accepted,
                _condition("ResolvedRefs", True, "ResolvedRefs", "every backend resolved")))
        if attached:
            attachments.append(_Attachment(route, attached))
        for name in counted:
            counts[name] += 1
    return _Attached(attachments, parents, counts)


def _parent(ref: ParentRef, route: RouteObject, gateway: GatewayObject, served: list[Listener],
            labels: NamespaceLabels, shares: SharesTag) -> tuple[Condition, list[Listener], list[Listener]]:
    """One parentRef naming the Gateway: its Accepted condition, the listeners the route is
    attached to through it (as ``attachedRoutes`` counts), and those of them that serve it."""
    named = [ls for ls in gateway.spec.listeners
             if (ref.section_name in (None, ls.name)) and (ref.port in (None, ls.port))]
    if not named:
        on_port = f" on port {ref.port}" if ref.port else ""
        return _condition("Accepted", False, "NoMatchingParent",
                          f"the Gateway has no listener {ref.section_name or ''}{on_port}"), [], []
    if not (admitting := [ls for ls in named if _admits(ls, route, gateway, labels)]):
        return _condition("Accepted", False, "NotAllowedByListeners", (
            f"no listener named admits {route.kind}s of namespace {route.metadata.namespace} (allowedRoutes and "
            "protocol: HTTP and HTTPS take HTTPRoutes and GRPCRoutes, TLS TLSRoutes, TCP TCPRoutes)")), [], []
    if not (matching := [ls for ls in admitting if hostnames_intersect(ls.hostname, route.spec.hostnames)]):
        return _condition("Accepted", False, "NoMatchingListenerHostname", (
            f"no listener's hostname matches the route's hostnames {', '.join(route.spec.hostnames)}")), [], []
    if route.metadata.namespace != gateway.namespace and not shares(route.metadata.namespace):
        return _condition("Accepted", False, "NotAllowedByListeners", (
            f"namespace {route.metadata.namespace} may not use the tag of the Gateway's node on its Tailnet "
            "(spec.tenants): a route puts its namespace's Services on the tailnet under that tag, so the "
            "Tailnet's admin must let the namespace use it too")), matching, []
    if not (usable := [ls for ls in matching if ls in served]):
        return _condition("Accepted", False, "NotAllowedByListeners", (
            "the listeners the route names are not served (see the Gateway's listener status)")), matching, []
    return _condition("Accepted", True, "Accepted", f"attached to {', '.join(ls.name for ls in usable)}"), \
        matching, usable


# -- rules -----------------------------------------------------------------------------------------


class RouteProblem(Exception):
    """A route that cannot be served: the Accepted or ResolvedRefs reason and a message."""

    def __init__(self, condition: str, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.condition, self.reason, self.message = condition, reason, message


def _path_change(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = raw.get("type")
    value = raw.get("replaceFullPath") if kind == "ReplaceFullPath" else raw.get("replacePrefixMatch")
    if kind not in ("ReplaceFullPath", "ReplacePrefixMatch") or not isinstance(value, str):
        raise RouteProblem("Accepted", "UnsupportedValue", f"{where}: a path modifier of type {kind!r} is not served")
    return {"type": kind, "value": value}


def _filter(raw: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    kind = raw.get("type", "")
    if kind not in _FILTERS:
        raise RouteProblem("Accepted", "UnsupportedValue", f"{where}: the filter {kind} is not served; the "
                           f"tailnet node serves {', '.join(_FILTERS)}")
    source, target = _FILTERS[kind]
    body = raw.get(source) or {}
    if kind in ("RequestHeaderModifier", "ResponseHeaderModifier"):
        return target, {k: body[k] for k in ("set", "add", "remove") if body.get(k)}
    out = {k: body[k] for k in ("hostname",) if body.get(k)}
    if body.get("path"):
        out["path"] = _path_change(body["path"], f"{where}.path")
    if kind == "RequestRedirect":
        out |= {k: body[k] for k in ("scheme", "port", "statusCode") if body.get(k) is not None}
    return target, out


def _grpc_path(method: _GrpcMethod, where: str) -> dict[str, Any]:
    """A GRPCRoute's method match as a path: a service and a method are the exact path
    ``/service/method``, a service alone the prefix ``/service/``; a method alone (any service)
    would take a regular expression, as would ``type: RegularExpression``."""
    if method.type != "Exact" or (method.method and not method.service):
        raise RouteProblem("Accepted", "UnsupportedValue", (
            f"{where}.method: only Exact matches naming a service (and optionally its method) are served: they "
            "are exact or prefix paths, and a regular expression would run on every request a tailnet peer sends"))
    if method.method:
        return {"path": f"/{method.service}/{method.method}", "pathType": "Exact"}
    return {"path": f"/{method.service}/" if method.service else "/", "pathType": "Prefix"}


def _match(match: RouteMatch, where: str) -> dict[str, Any]:
    if isinstance(match.method, _GrpcMethod):
        grpc = _grpc_path(match.method, where)
        if bad := [m.name for m in match.headers if m.type != "Exact"]:
            raise RouteProblem("Accepted", "UnsupportedValue", f"{where}.headers: {', '.join(bad)}: only Exact "
                               "matches are served")
        return grpc | ({"headers": [{"name": m.name, "value": m.value} for m in match.headers]} if match.headers
                       else {})
    kind = _PATH_TYPES.get(match.path.type)
    if kind is None:
        raise RouteProblem("Accepted", "UnsupportedValue", f"{where}.path: {match.path.type} paths are not served "
                           "(Exact and PathPrefix are)")
    out: dict[str, Any] = {"path": match.path.value, "pathType": kind}
    for key, entries in (("headers", match.headers), ("queryParams", match.query_params)):
        if bad := [m.name for m in entries if m.type != "Exact"]:
            raise RouteProblem("Accepted", "UnsupportedValue", (
                f"{where}.{key}: {', '.join(bad)}: only Exact matches are served (a regular expression would run "
                "on every request a tailnet peer sends)"))
        if entries:
            out[key] = [{"name": m.name, "value": m.value} for m in entries]
    if match.method:
        out["method"] = match.method
    return out


@dataclass(frozen=True)
class _Backends:
    """What a rule's backendRefs are resolved against: the Gateway's namespace (where the node
    runs), whether Services exist, and the ReferenceGrants."""

    home: str
    services: ServiceLookup
    granted: Granted


def _backends(rule: RouteRule, route: RouteObject, where: str, lookup: _Backends
              ) -> tuple[list[dict[str, Any]], Condition | None]:
    """The rule's backends with their weights (a failing one kept at weight 0), and the
    ResolvedRefs failure of the first that fails. A Service of another namespace than the route's
    needs a ReferenceGrant there; one of another namespace than the Gateway's carries it."""
    out: list[dict[str, Any]] = []
    failed: Condition | None = None
    ns = route.metadata.namespace
    for k, ref in enumerate(rule.backend_refs):
        at = f"{where}.backendRefs[{k}]"
        problem: Condition | None = None
        target = ref.namespace or ns
        if (ref.group, ref.kind) != ("", "Service"):
            problem = _condition("ResolvedRefs", False, "InvalidKind", f"{at}: {ref.kind} is not a Service")
        elif target != ns and not lookup.granted(route.kind, ns, "Service", target, ref.name):
            problem = _condition("ResolvedRefs", False, "RefNotPermitted", (
                f"{at}: Service {target}/{ref.name} is in another namespace, and no ReferenceGrant there lets "
                f"{route.kind}s of namespace {ns} refer to it"))
        elif ref.port is None:
            problem = _condition("ResolvedRefs", False, "UnsupportedValue", f"{at}: a Service needs a port")
        elif (service := lookup.services(target, ref.name)) is None:
            problem = _condition("ResolvedRefs", False, "BackendNotFound",
                                 f"{at}: Service {target}/{ref.name} not found")
        elif isinstance(dialled := dial_port(service, ref.port), str):
            problem = _condition("ResolvedRefs", False, "UnsupportedValue", f"{at}: {dialled}")
        if problem is not None:
            failed = failed or problem
        if ref.port is not None and ref.kind == "Service":
            away = {"namespace": target} if target != lookup.home else {}
            port = dialled if problem is None and isinstance(dialled, int) else ref.port
            out.append({"service": ref.name, "port": port, **away, "weight": 0 if problem else ref.weight})
    return out, failed


def _paths_of(route: RouteObject, lookup: _Backends) -> tuple[list[dict[str, Any]], Condition | None]:
    """Every path of a route (a rule's matches, each with the rule's filters and backends) and the
    ResolvedRefs failure, if any; raises :class:`RouteProblem` for what cannot be served at all."""
    paths: list[dict[str, Any]] = []
    failed: Condition | None = None
    for i, rule in enumerate(route.spec.rules):
        where = f"spec.rules[{i}]"
        filters = dict(_filter(f, f"{where}.filters[{j}]") for j, f in enumerate(rule.filters))
        backends, problem = _backends(rule, route, where, lookup)
        failed = failed or problem
        target: dict[str, Any]
        if "redirect" in filters:
            target = {}
        elif len(backends) == 1 and backends[0]["weight"] > 0:
            target = {"backend": {k: v for k, v in backends[0].items() if k != "weight"}}
        elif backends:
            target = {"backends": backends}
        else:
            # No backend: the specification's 500, as a backend that takes no requests.
            target = {"backends": [{"service": route.metadata.name, "port": 1, "weight": 0}]}
        for j, match in enumerate(rule.matches):
            path = {**_match(match, f"{where}.matches[{j}]"), **filters, **target}
            try:
                HostPath.model_validate(path)
            except ValidationError as exc:
                error = exc.errors()[0]
                raise RouteProblem("Accepted", "UnsupportedValue",
                                   f"{where}.matches[{j}]: {error['msg'].removeprefix('Value error, ')}") from None
            paths.append(path)
    return paths, failed


# -- the Gateway ---------------------------------------------------------------------------------


def _listener_problem(listener: Listener, gateway: GatewayObject, certificate: CertificateProblem,
                      granted: Granted) -> Condition | None:
    if listener.protocol not in ROUTE_KINDS:
        return _condition("Accepted", False, "UnsupportedProtocol", (
            f"listener {listener.name}: {listener.protocol} is not served; the tailnet node serves HTTP, HTTPS (TLS "
            "terminated by the node), TLS (passed through, routed by SNI) and TCP listeners"))
    clash = next((ls for ls in gateway.spec.listeners if ls.port == listener.port and ls.protocol != listener.protocol),
                 None)
    if clash is not None:
        return _condition("Accepted", False, "ProtocolConflict", (
            f"listener {listener.name}: listener {clash.name} is on port {listener.port} too, with {clash.protocol}; "
            "the listeners of one port share one protocol"))
    if listener.protocol == "TCP" and (first := next(ls for ls in gateway.spec.listeners
                                                     if ls.port == listener.port)) is not listener:
        return _condition("Accepted", False, "HostnameConflict", (
            f"listener {listener.name}: listener {first.name} has TCP port {listener.port} already; a TCP port "
            "takes one listener (nothing tells its connections apart)"))
    if unserved := _route_kinds(listener)[1]:
        return _condition("ResolvedRefs", False, "InvalidRouteKinds", (
            f"listener {listener.name}: allowedRoutes.kinds names {', '.join(unserved)}; a {listener.protocol} "
            f"listener takes {' and '.join(k + 's' for k in ROUTE_KINDS[listener.protocol])}"))
    if listener.protocol in ("HTTP", "TCP"):
        return None
    tls = listener.tls or _TLS()
    if listener.protocol == "TLS":
        if tls.mode != "Passthrough":
            return _condition("Accepted", False, "UnsupportedValue", (
                f"listener {listener.name}: a TLS listener's tls.mode {tls.mode} is not served (Passthrough is: the "
                "backend terminates TLS; for TLS the node terminates, use an HTTPS listener)"))
        return None
    if tls.mode != "Terminate":
        return _condition("Accepted", False, "UnsupportedValue", f"listener {listener.name}: tls.mode {tls.mode} is "
                          "not served yet (Terminate is)")
    if not tls.certificate_refs:
        return _condition("ResolvedRefs", False, "InvalidCertificateRef", f"listener {listener.name} names no "
                          "certificate (tls.certificateRefs)")
    ref = tls.certificate_refs[0]
    if (ref.group, ref.kind) != ("", "Secret"):
        return _condition("ResolvedRefs", False, "InvalidCertificateRef", f"listener {listener.name}: "
                          f"{ref.kind} is not a Secret")
    namespace = ref.namespace or gateway.namespace
    if namespace != gateway.namespace and not granted("Gateway", gateway.namespace, "Secret", namespace, ref.name):
        return _condition("ResolvedRefs", False, "RefNotPermitted", (
            f"listener {listener.name}: Secret {namespace}/{ref.name} is in another namespace, and no "
            f"ReferenceGrant there lets Gateways of namespace {gateway.namespace} refer to it"))
    if (problem := certificate(namespace, ref.name)) is not None:
        return _condition("ResolvedRefs", False, "InvalidCertificateRef", (
            f"listener {listener.name}: Secret {namespace}/{ref.name}: {problem}"))
    return None


def _route_order(route: RouteObject) -> tuple[str, str, str]:
    return route.metadata.creation_timestamp, route.metadata.namespace, route.metadata.name


def as_ingress(gateway: GatewayObject, routes: Iterable[RouteObject], tailnet: str, *, tag: str,
               hostname: str, services: ServiceLookup, certificates: CertificateProblem,
               labels: NamespaceLabels, shares: SharesTag = _nobody, granted: Granted = _nothing) -> GatewayPlan:
    """The TailnetIngress shape of ``gateway`` on ``tailnet`` with the HTTPRoutes that name it
    (module docstring), and what its listeners' and routes' status must say. By default no route
    of another namespace attaches (``shares``) and no ReferenceGrant permits (``granted``)."""
    ordered = sorted(routes, key=_route_order)
    listeners = {ls.name: ListenerResult(ls.name) for ls in gateway.spec.listeners}
    served: list[Listener] = []
    for listener in gateway.spec.listeners:
        problem = _listener_problem(listener, gateway, certificates, granted)
        result = listeners[listener.name]
        result.supported_kinds = _route_kinds(listener)[0]
        if problem is None:
            served.append(listener)
            resolved = "the certificate's Secret found" if listener.protocol == "HTTPS" else "nothing to resolve"
            result.conditions += [_condition("Accepted", True, "Accepted", "served"),
                                  _condition("ResolvedRefs", True, "ResolvedRefs", resolved)]
        elif problem.type == "Accepted":
            if problem.reason == "UnsupportedValue":  # a tls.mode not served: it takes no route of any kind
                result.supported_kinds = []
            result.conditions += [problem, _condition("ResolvedRefs", True, "ResolvedRefs", "nothing to resolve")]
        else:
            result.conditions += [_condition("Accepted", True, "Accepted", "accepted; not served until its "
                                             "references resolve"), problem]
    attached = _attach(gateway, ordered, served, labels, shares)
    attachments, parents = attached.attachments, attached.parents
    for name, count in attached.counts.items():
        listeners[name].attached_routes = count
    hosts: dict[int, dict[str, dict[str, Any]]] = {}
    lookup = _Backends(gateway.namespace, services, granted)
    usable = {a.route.key: a for a in attachments}
    streams: list[tuple[_Attachment, dict[str, Any] | None]] = []
    kinds: dict[tuple[int, str], str] = {}
    for route in ordered:
        if route.key not in parents:
            continue
        # Every route naming the Gateway has its backends resolved, served or not: its
        # ResolvedRefs says so even while the listener it names waits for a certificate.
        try:
            if route.streams:
                backend, unresolved = _stream_backend(route, lookup)
            else:
                paths, unresolved = _paths_of(route, lookup)
        except RouteProblem as exc:
            for parent in parents[route.key]:
                if exc.condition == "ResolvedRefs":
                    parent.resolved_refs = _condition("ResolvedRefs", False, exc.reason, exc.message)
                elif parent.accepted.status:
                    parent.accepted = _condition("Accepted", False, exc.reason, exc.message)
            continue
        for parent in parents[route.key]:
            if unresolved is not None:
                parent.resolved_refs = unresolved
        if (attachment := usable.get(route.key)) is None:
            continue
        if route.streams:
            streams.append((attachment, backend))
            continue
        _add_route_hosts(gateway, attachment, paths, hosts, kinds, parents)
    _add_listener_hosts(gateway, hosts, served)
    exposes = _stream_exposes(streams, parents)
    for port, by_name in sorted(hosts.items()):
        for h in by_name.values():
            if len(h["paths"]) > PATHS_MAX:
                return _refused(listeners, parents, "TooManyPaths", (
                    f"host {h['name']} has {len(h['paths'])} paths from its routes' rules and matches; a host serves "
                    f"at most {PATHS_MAX}"))
        for grpc in (False, True):
            entries = [h for name, h in by_name.items() if (kinds.get((port, name)) == "GRPCRoute") == grpc]
            exposes += _http_exposes(gateway, port, entries, grpc)
    if len(exposes) > EXPOSES_MAX:
        return _refused(listeners, parents, "TooManyHosts", (
            f"the Gateway's listeners serve {sum(len(e.get('hosts') or [1]) for e in exposes)} hosts and TCP "
            f"ports over {len(exposes)} groups; a tailnet node serves at most {EXPOSES_MAX} groups (a TCP port, the "
            f"hosts of one TLSRoute, or up to {HOSTS_MAX} HTTP hosts)"))
    if not exposes and not served:
        return _refused(listeners, parents, "ListenersNotValid", "no listener can be served: see the listeners' "
                        "conditions")
    try:
        # Only TLS and TCP listeners, no route served on them yet: a node with no port open. The
        # TailnetIngress schema wants an expose; the shape is checked with one, then has none.
        ingress = TailnetIngress.model_validate({
            "metadata": {"name": object_name_of(gateway.name), "namespace": gateway.namespace,
                         "uid": gateway.metadata.uid},
            "spec": {"tailnetRef": {"name": tailnet}, "tag": tag, "hostname": hostname,
                     "exposes": exposes or [_NO_PORT]}})
        if not exposes:
            ingress = ingress.model_copy(update={"spec": ingress.spec.model_copy(update={"exposes": []})})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        return _refused(listeners, parents, "Invalid",
                        f"the Gateway cannot be served as a tailnet node: {where}: {error['msg']}")
    invalid = [ls.name for ls in gateway.spec.listeners if ls not in served]
    accepted = _condition("Accepted", True, "ListenersNotValid", (
        f"served as a tailnet node without the listeners {', '.join(invalid)}: see their conditions")) if invalid \
        else _condition("Accepted", True, "Accepted", "served as a tailnet node")
    return GatewayPlan(ingress, accepted, list(listeners.values()), parents)


def _add_route_hosts(gateway: GatewayObject, attachment: _Attachment, paths: list[dict[str, Any]],
                     hosts: dict[int, dict[str, dict[str, Any]]], kinds: dict[tuple[int, str], str],
                     parents: dict[RouteKey, list[ParentResult]]) -> None:
    """An HTTPRoute's or GRPCRoute's paths added to the hosts of the listeners it is attached to.
    A host is of the kind of the oldest route that made it: its requests are spoken to the
    backends as HTTP/1.1 or as HTTP/2 (gRPC), never both. A route left with no host because
    routes of the other kind have them all is not Accepted (``NotAllowedByListeners``)."""
    route, asked, got = attachment.route, False, False
    for listener in attachment.listeners:
        tls = _listener_tls(gateway, listener)
        for name in _route_names(listener, route):
            asked = True
            if kinds.setdefault((listener.port, name), route.kind) != route.kind:
                continue
            got = True
            host = hosts.setdefault(listener.port, {}).setdefault(
                name, {"name": name, **tls, "paths": [], "unmatchedPaths": "NotFound"})
            host["paths"].extend(paths)
    if asked and not got:
        for parent in parents[route.key]:
            if parent.accepted.status:
                parent.accepted = _condition("Accepted", False, "NotAllowedByListeners", (
                    f"every hostname the {route.kind} asks for is served to older routes of another kind (a host "
                    "speaks HTTP/1.1 or gRPC to its backends, not both)"))


def _http_exposes(gateway: GatewayObject, port: int, entries: list[dict[str, Any]], grpc: bool
                  ) -> list[dict[str, Any]]:
    """The http exposes of ``port``'s hosts of one kind, :data:`HOSTS_MAX` hosts each, plaintext on
    an HTTP listener's port; gRPC hosts speak HTTP/2 to their backends (h2c with prior knowledge),
    whatever the listener's protocol."""
    if not entries:
        return []
    first: dict[str, Any] = next((p for h in entries for p in h["paths"]), {})
    backend = first.get("backend") or next((b for b in first.get("backends", [])), None) or \
        {"service": gateway.name, "port": port}
    # The expose's own backend is never asked (every host answers 404 where no path matches); its
    # protocol is how the paths' backends are spoken to.
    backend = {"service": backend["service"], "port": backend["port"], **({"protocol": "h2"} if grpc else {})}
    plaintext = all("tls" not in h for h in entries)
    stem = "grpc" if grpc else "http" if plaintext else "https"
    return [{"name": f"{stem}-{port}-{k // HOSTS_MAX}", "mode": "http", "port": port, "backend": backend,
             "hosts": entries[k:k + HOSTS_MAX], **({"plaintext": True} if plaintext else {})}
            for k in range(0, len(entries), HOSTS_MAX)]


def _route_names(listener: Listener, route: RouteObject) -> list[str]:
    """The hosts of ``listener``'s port that serve ``route``: :func:`_served_names`, each one a
    hostname of the route covers (``*`` only for a route without hostnames)."""
    names = _served_names(listener, [route])
    if not route.spec.hostnames:
        return names
    return [n for n in names if n != ANY_HOST and any(_covers(h.lower(), n) for h in route.spec.hostnames)]


def _stream_backend(route: RouteObject, lookup: _Backends) -> tuple[dict[str, Any] | None, Condition | None]:
    """The Service a TLSRoute's or TCPRoute's connections go to (its one rule's backends, those of
    weight 0 left out), None when none resolves (its connections are refused, as the
    specification asks), and the ResolvedRefs failure; several weighted backends are
    :class:`RouteProblem` (a connection goes to one Service, chosen by no weight yet)."""
    rule = route.spec.rules[0] if route.spec.rules else RouteRule()
    backends, failed = _backends(rule, route, "spec.rules[0]", lookup)
    weighted = [b for b in backends if b["weight"] > 0]
    if len(weighted) > 1:
        raise RouteProblem("Accepted", "UnsupportedValue", (
            f"spec.rules[0].backendRefs: {len(weighted)} backends with weights; a {route.kind}'s connections go to "
            "one Service (give the others weight 0)"))
    return ({k: v for k, v in weighted[0].items() if k != "weight"} if weighted else None), failed


def _stream_exposes(streams: list[tuple[_Attachment, dict[str, Any] | None]],
                    parents: dict[RouteKey, list[ParentResult]]) -> list[dict[str, Any]]:
    """The tcp and tls exposes of the TCPRoutes and TLSRoutes served, oldest route first: a TCP
    listener's port serves its oldest route; a TLS listener's port one expose per route, each host
    name going to the oldest route that asks for it. A route that gets nothing of the listeners it
    is attached to because older routes have it is not Accepted (``NotAllowedByListeners``)."""
    exposes: list[dict[str, Any]] = []
    taken: dict[int, set[str]] = {}
    for attachment, backend in streams:
        route, won = attachment.route, False
        for listener in attachment.listeners:
            port, names = listener.port, taken.setdefault(listener.port, set())
            if listener.protocol == "TCP":
                if not names:
                    names.add(ANY_HOST)  # the port is taken: a TCP port has no names to share out
                    won = True
                    if backend is not None:
                        exposes.append({"name": f"tcp-{port}", "mode": "tcp", "port": port, "backend": backend})
                continue
            free = [n for n in _route_names(listener, route) if n not in names]
            names.update(free)
            won = won or bool(free)
            for k in range(0, len(free) if backend is not None else 0, HOSTS_MAX):
                count = sum(1 for e in exposes if e["port"] == port)
                exposes.append({"name": f"tls-{port}-{count}", "mode": "tls", "port": port, "backend": backend,
                                "hosts": [{"name": n} for n in free[k:k + HOSTS_MAX]]})
        if not won:
            for parent in parents[route.key]:
                if parent.accepted.status:
                    parent.accepted = _condition("Accepted", False, "NotAllowedByListeners", (
                        f"the listeners the {route.kind} is attached to serve older routes on every name it asks "
                        "for (a TCP listener serves one route; a TLS listener each name for one route)"))
    return exposes


def _listener_tls(gateway: GatewayObject, listener: Listener) -> dict[str, Any]:
    """The ``tls`` of a host an HTTPS listener serves: its first certificate's Secret, or that
    Secret's copy in the Gateway's namespace (:func:`certificate_copy_name`); none over HTTP."""
    if listener.protocol != "HTTPS":
        return {}
    ref = (listener.tls or _TLS()).certificate_refs[0]
    namespace = ref.namespace or gateway.namespace
    name = ref.name if namespace == gateway.namespace else certificate_copy_name(gateway.name, namespace, ref.name)
    return {"tls": {"secretName": name}}


def _add_listener_hosts(gateway: GatewayObject, hosts: dict[int, dict[str, dict[str, Any]]],
                        served: list[Listener]) -> None:
    """Each served HTTP and HTTPS listener's own host (its hostname, else ``*``) when no route
    made it, with no paths and no fallback: the node listens on the port before the first route
    (the Gateway is Programmed, with an address), and a name the listener covers that no route
    serves gets 404 (over TLS, after a handshake with the listener's certificate)."""
    for listener in served:
        if "HTTPRoute" not in ROUTE_KINDS[listener.protocol]:
            continue
        name = (listener.hostname or "").lower() or ANY_HOST
        tls = _listener_tls(gateway, listener)
        hosts.setdefault(listener.port, {}).setdefault(
            name, {"name": name, **tls, "paths": [], "unmatchedPaths": "NotFound"})


def _refused(listeners: dict[str, ListenerResult], parents: dict[RouteKey, list[ParentResult]],
             reason: str, message: str) -> GatewayPlan:
    return GatewayPlan(None, _condition("Accepted", False, reason, message), list(listeners.values()), parents)


# -- statuses ------------------------------------------------------------------------------------


def _wire(condition: Condition, generation: int, now: str) -> dict[str, Any]:
    return {"type": condition.type, "status": "True" if condition.status else "False", "reason": condition.reason,
            "message": condition.message, "observedGeneration": generation, "lastTransitionTime": now}


def _kept_time(found: list[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the transition time of the condition it replaces when its status did not change."""
    old = next((c for c in found if c.get("type") == new["type"]), None)
    if old is not None and old.get("status") == new["status"] and old.get("lastTransitionTime"):
        return {**new, "lastTransitionTime": old["lastTransitionTime"]}
    return new


def gateway_status(plan: GatewayPlan, gateway: GatewayObject, node: Mapping[str, Any] | None, *, ready: bool,
                   current: Mapping[str, Any] | None, now: str, waiting: str = "") -> dict[str, Any]:
    """The Gateway's ``status``: Accepted as the plan says, Programmed once its node serves
    (``ready``; else Pending, saying ``waiting``: why), every listener's conditions and attached
    routes, and the node's addresses (each tailnet IP, then its MagicDNS name as a Hostname) once it
    has them. Transition times are kept for conditions whose status did not change (``current``:
    the status as stored)."""
    generation = gateway.metadata.generation
    serving = ready and plan.ingress is not None
    programmed = Condition("Programmed", serving, "Programmed" if serving else "Pending",
                           "the tailnet node serves the Gateway" if serving
                           else f"the tailnet node does not serve the Gateway yet{': ' + waiting if waiting else ''}")
    found = list((current or {}).get("conditions") or [])
    conditions = [_kept_time(found, _wire(c, generation, now)) for c in (plan.accepted, programmed)]
    stored = {ls.get("name"): ls for ls in (current or {}).get("listeners") or []}
    listeners = []
    for result in plan.listeners:
        was = list((stored.get(result.name) or {}).get("conditions") or [])
        served = all(c.status for c in result.conditions)
        listener_programmed = Condition("Programmed", served and ready, "Programmed" if served and ready else "Pending",
                                        "served" if served and ready else "not served yet")
        listeners.append({
            "name": result.name, "attachedRoutes": result.attached_routes,
            "supportedKinds": result.supported_kinds,
            "conditions": [_kept_time(was, _wire(c, generation, now))
                           for c in (*result.conditions, listener_programmed)]})
    out: dict[str, Any] = {"conditions": conditions, "listeners": listeners}
    addresses = [{"type": "IPAddress", "value": str(a)} for a in (node or {}).get("addresses") or []]
    name = str((node or {}).get("name") or "").rstrip(".")
    if "." in name:
        addresses.append({"type": "Hostname", "value": name})
    if addresses:
        out["addresses"] = addresses
    return out


def route_parents(route: Mapping[str, Any], results: list[ParentResult], *, now: str) -> list[dict[str, Any]]:
    """``status.parents`` of an HTTPRoute: the entries of other controllers and of other Gateways
    kept, this controller's entries for ``results``' parents replaced (transition times kept)."""
    generation = int((route.get("metadata") or {}).get("generation") or 0)
    ours = {_parent_key(r.parent) for r in results}
    stored = list((route.get("status") or {}).get("parents") or [])
    kept = [p for p in stored
            if p.get("controllerName") != CONTROLLER or _parent_key(p.get("parentRef") or {}) not in ours]
    previous = {_parent_key(p.get("parentRef") or {}): p for p in stored if p.get("controllerName") == CONTROLLER}
    written = []
    for result in results:
        was = list((previous.get(_parent_key(result.parent)) or {}).get("conditions") or [])
        written.append({"parentRef": result.parent, "controllerName": CONTROLLER,
                        "conditions": [_kept_time(was, _wire(c, generation, now))
                                       for c in (result.accepted, result.resolved_refs)]})
    return [*kept, *written]


def _parent_key(ref: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(ref.get(k) or "") for k in ("group", "kind", "namespace", "name", "sectionName", "port"))
