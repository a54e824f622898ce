"""TailnetIngress: exposes in-cluster Services on the tailnet as one tagged node."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator
from pydantic.json_schema import SkipJsonSchema

from tailnet_agent.contract.addresses import shared_address_problem
from tailnet_agent.contract.exposes import (
    IDENTITY_PREFIXES,
    RESERVED_HEADER_TEXT,
    RESERVED_HEADERS,
    reserved_header,
)
from tailnet_operator.api.common import (
    ANY_HOST,
    DNS_SUBDOMAIN_PATTERN,
    ApiModel,
    BoundedString,
    Conditions,
    DNS1035Label,
    DNSLabel,
    DNSName,
    Generation,
    HostName,
    IPAddress,
    LocalSecretKeyRef,
    ObjectMeta,
    Port,
    Tag,
    TailnetRef,
    Timestamp,
    cel,
    cel_string,
    duplicates,
    validations,
)
from tailnet_operator.api.egress import MAX_REPLICAS, NodeStatus, PreAuthKeyStatus

# The cross-expose host-name rule is quadratic in both; these keep it within the CEL budget.
EXPOSES_MAX = 8
HOSTS_MAX = 4
PATHS_MAX = 32
"""Paths of one host (an Ingress rule's paths, those of its rules without a host included)."""
PATH_MAX_LENGTH = 256
DNS_TEMPLATE_PLACEHOLDERS = ("{hostname}", "{name}", "{namespace}")


def render_dns_template(template: str, *, hostname: str, name: str, namespace: str) -> str:
    """Expand ``dnsTemplate``; the CRD checks the same expansion with placeholder values."""
    return template.replace("{hostname}", hostname).replace("{name}", name).replace("{namespace}", namespace)


class IssuerRef(ApiModel):
    """A cert-manager issuer."""

    name: DNSName = Field(description="Name of the issuer.")
    kind: Literal["Issuer", "ClusterIssuer"] = Field(
        default="Issuer", description="Issuer or ClusterIssuer. Defaults to Issuer."
    )
    group: DNSName = Field(
        default="cert-manager.io", description="API group of the issuer. Defaults to cert-manager.io."
    )


class CertManagerTLS(ApiModel):
    """A certificate the operator requests from cert-manager."""

    issuer_ref: IssuerRef = Field(description="The issuer that signs the certificate.")


class HostTLS(ApiModel):
    """Where the agent gets the certificate it terminates TLS with."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "has(self.secretName) != has(self.certManager)",
                "set exactly one of secretName and certManager",
            )
        )
    )

    secret_name: DNSName | None = Field(
        default=None, description="A kubernetes.io/tls Secret in this namespace; reloaded when it changes."
    )
    cert_manager: CertManagerTLS | None = Field(
        default=None, description="Request the certificate from cert-manager for name and alias."
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.secret_name is None) == (self.cert_manager is None):
            raise ValueError("tls: set exactly one of secretName and certManager")
        return self


class PathBackend(ApiModel):
    """The in-cluster Service a path's requests go to."""

    service: DNS1035Label = Field(description="Name of a Service in this namespace.")
    port: Port = Field(description="Port of the Service.")
    namespace: SkipJsonSchema[DNSLabel | None] = None
    """The Service's namespace when not the ingress's: set only by a Gateway's translation (an
    HTTPRoute of another namespace, or a backendRef a ReferenceGrant permits). Not in the CRD's
    schema, so kube-apiserver prunes it from every TailnetIngress a tenant writes."""


HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]
MATCHES_MAX = 8
"""Header matches, query matches, weighted backends and header edits of one path, each."""
HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"
"""An HTTP field name (RFC 9110 token)."""
_RESERVED_RULE = cel(
    "!(self.lowerAscii() in [" + ", ".join(f"'{h}'" for h in sorted(RESERVED_HEADERS)) + "]) && "
    + " && ".join(f"!self.lowerAscii().replace('_', '-').startsWith('{p}')" for p in IDENTITY_PREFIXES),
    RESERVED_HEADER_TEXT,
)
HeaderName = Annotated[str, StringConstraints(pattern=HEADER_NAME_PATTERN, min_length=1, max_length=256)]
EditedHeaderName = Annotated[
    str,
    StringConstraints(pattern=HEADER_NAME_PATTERN, min_length=1, max_length=256),
    WithJsonSchema({"type": "string", "pattern": HEADER_NAME_PATTERN, "minLength": 1, "maxLength": 256,
                    "x-kubernetes-validations": [_RESERVED_RULE]}),
    AfterValidator(lambda name: _not_reserved(name)),
]
HeaderText = Annotated[str, StringConstraints(max_length=4096)]


def _not_reserved(name: str) -> str:
    if reserved_header(name):
        raise ValueError(f"{name} {RESERVED_HEADER_TEXT}")
    return name


class HeaderMatch(ApiModel):
    """A header (name without case) or query parameter (name with case) a request must carry with
    exactly this value."""

    name: HeaderName = Field(description="The header's or query parameter's name.")
    value: HeaderText = Field(description="The exact value (a repeated header: its values joined by ', ').")


class HeaderValue(ApiModel):
    """A header to set or add."""

    name: EditedHeaderName = Field(description="The header's name.")
    value: HeaderText = Field(description="Its value.")


class HeaderEdits(ApiModel):
    """Headers to set (replacing any of the name), add (beside them) and remove, in that order.
    Hop-by-hop headers, Host, the forwarding headers and Tailnet-*/Tailscale-* are the agent's."""

    set: list[HeaderValue] | None = Field(default=None, max_length=MATCHES_MAX, description="Headers to set.")
    add: list[HeaderValue] | None = Field(default=None, max_length=MATCHES_MAX, description="Headers to add.")
    remove: list[EditedHeaderName] | None = Field(default=None, max_length=MATCHES_MAX,
                                                  description="Names of headers to remove.")


class WeightedBackend(PathBackend):
    """A Service of a path and its share of the path's requests."""

    weight: int = Field(default=1, ge=0, le=1_000_000,
                        description="The share: weight / the sum of the weights; 0 sends none. Defaults to 1.")


class PathChange(ApiModel):
    """A new request path: the whole path, or the part a Prefix path matched."""

    type: Literal["ReplaceFullPath", "ReplacePrefixMatch"] = Field(
        description="ReplaceFullPath, or ReplacePrefixMatch (a Prefix path only: /foo/x under /foo to /bar is /bar/x).")
    value: str = Field(pattern="^/", max_length=PATH_MAX_LENGTH, description="The new path (or prefix).")


class Redirect(ApiModel):
    """An answer the agent gives instead of a backend: the same request's URL with these changed."""

    scheme: Literal["http", "https"] | None = Field(default=None, description="Defaults to https.")
    hostname: DNSName | None = Field(default=None, description="Defaults to the host the request named.")
    port: Port | None = Field(
        default=None,
        description="Defaults to the scheme's own port when scheme is set, else the port the request came to.")
    path: PathChange | None = Field(default=None, description="Defaults to the request's path (the query is kept).")
    status_code: Literal[301, 302, 303, 307, 308] = Field(default=302, description="Defaults to 302.")


class Rewrite(ApiModel):
    """What the backend is sent instead of what the client asked."""

    hostname: DNSName | None = Field(default=None, description="The Host the backend gets.")
    path: PathChange | None = Field(default=None, description="The path the backend gets (the query is kept).")


class HostPath(ApiModel):
    """One path of a host and where its requests go (an Ingress's HTTPIngressPath, with the
    matches and filters of a Gateway API HTTPRoute rule)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel("[has(self.backend), has(self.backends), has(self.redirect)].filter(x, x).size() == 1",
                "set exactly one of backend, backends and redirect"),
            cel("!has(self.redirect) || (!has(self.rewrite) && !has(self.requestHeaders))",
                "a redirect goes to no backend, so it takes no rewrite or requestHeaders"),
            cel("self.pathType == 'Prefix' || ((!has(self.rewrite) || !has(self.rewrite.path) || "
                "self.rewrite.path.type == 'ReplaceFullPath') && (!has(self.redirect) || !has(self.redirect.path) "
                "|| self.redirect.path.type == 'ReplaceFullPath'))",
                "ReplacePrefixMatch goes with pathType Prefix only"),
        )
    )

    path: str = Field(
        pattern="^/", max_length=PATH_MAX_LENGTH,
        description="The request path to match (without the query), starting with /.",
    )
    path_type: Literal["Exact", "Prefix"] = Field(
        default="Prefix",
        description=(
            "Exact matches the whole path; Prefix matches by path element (/foo matches /foo and /foo/bar, "
            "not /foobar). The longest matching path by elements wins, Exact before Prefix of as many elements "
            "(/foo/ has the elements of /foo), then the most characters, then a path with a method, then the "
            "most headers, then the most query parameters, then the first listed. "
            "Defaults to Prefix."
        ),
    )
    method: HttpMethod | None = Field(default=None, description="Only requests of this method.")
    headers: list[HeaderMatch] | None = Field(default=None, max_length=MATCHES_MAX,
                                              description="Headers the request must carry, with these values.")
    query_params: list[HeaderMatch] | None = Field(default=None, max_length=MATCHES_MAX,
                                                   description="Query parameters the request must carry.")
    backend: PathBackend | None = Field(
        default=None,
        description="Where the path's requests go; spoken to as the expose's backend is (scheme, protocol, CA).",
    )
    backends: list[WeightedBackend] | None = Field(
        default=None, min_length=1, max_length=MATCHES_MAX,
        description="Several Services sharing the requests by weight (every weight 0: 500).")
    redirect: Redirect | None = Field(default=None, description="Answer with a redirect instead of a backend.")
    rewrite: Rewrite | None = Field(default=None, description="Change the Host or the path the backend gets.")
    request_headers: HeaderEdits | None = Field(default=None, description="Edit the headers the backend gets.")
    response_headers: HeaderEdits | None = Field(default=None, description="Edit the headers the client gets.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if sum(x is not None for x in (self.backend, self.backends, self.redirect)) != 1:
            raise ValueError("paths: set exactly one of backend, backends and redirect")
        if self.redirect is not None and (self.rewrite is not None or self.request_headers is not None):
            raise ValueError("paths: a redirect goes to no backend, so it takes no rewrite or requestHeaders")
        changes = [c.path for c in (self.rewrite, self.redirect) if c is not None and c.path is not None]
        if self.path_type != "Prefix" and any(c.type == "ReplacePrefixMatch" for c in changes):
            raise ValueError("paths: ReplacePrefixMatch goes with pathType Prefix only")
        for kind, matches in (("headers", self.headers), ("queryParams", self.query_params)):
            names = [m.name.lower() if kind == "headers" else m.name for m in matches or []]
            if dups := duplicates(names):
                raise ValueError(f"paths: {kind} names {', '.join(dups)} twice")
        return self


class VirtualHost(ApiModel):
    """A name an http or tls expose answers to (matched by SNI; over plaintext http by Host)."""

    model_config = ConfigDict(json_schema_extra=validations(
        cel("!self.name.startsWith('*') || !has(self.alias)",
            "a wildcard host (* or *.name) has no DNS name, so it takes no alias", ".alias")))

    name: HostName = Field(description=(
        "Fully qualified DNS name, e.g. grafana.apps.example.internal; *. and a name, every name under it "
        "(*.apps.example.internal); or *, any name. SNI and Host pick the closest host of the port: an exact "
        "name, then the longest *. name, then *. A wildcard host gets no DNS name and no alias."))
    alias: DNSLabel | None = Field(
        default=None, description="Optional short name under the same zones, e.g. grafana."
    )
    tls: HostTLS | None = Field(
        default=None, description=(
            "The certificate for this name; required for mode http unless the expose is plaintext, not allowed "
            "for mode tls (the backend terminates TLS)."))
    paths: list[HostPath] | None = Field(
        default=None,
        max_length=PATHS_MAX,
        description=(
            "Optional path routing: a request goes to the backend of its longest matching path; without "
            "paths every request goes to the expose's backend."
        ),
    )
    unmatched_paths: Literal["Backend", "NotFound"] = Field(
        default="Backend",
        description=(
            "With paths: what a request no path matches gets, the expose's backend (Backend) or "
            "404 Not Found (NotFound). Defaults to Backend."
        ),
    )

    @model_validator(mode="after")
    def _any_host(self) -> Self:
        if self.name.startswith(ANY_HOST) and self.alias is not None:
            raise ValueError("alias: a wildcard host (* or *.name) has no DNS name, so it takes no alias")
        return self


class Backend(ApiModel):
    """The in-cluster Service traffic is forwarded to."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.caSecretRef) || self.scheme == 'https'",
                "caSecretRef requires scheme https",
                ".caSecretRef",
            )
        )
    )

    service: DNS1035Label = Field(description="Name of a Service in this namespace.")
    port: Port = Field(description="Port of the Service.")
    namespace: SkipJsonSchema[DNSLabel | None] = None
    """The Service's namespace when not the ingress's, as a path's (:class:`PathBackend`): set only
    by a Gateway's translation (a TLSRoute's or TCPRoute's backendRef a ReferenceGrant permits);
    pruned by kube-apiserver from every TailnetIngress a tenant writes."""
    scheme: Literal["http", "https"] = Field(
        default="http",
        description="http mode only: speak HTTP or HTTPS to the backend. Defaults to http.",
    )
    ca_secret_ref: LocalSecretKeyRef | None = Field(
        default=None,
        description="https only: verify the backend against this CA instead of the system roots.",
    )
    protocol: Literal["http1", "h2"] = Field(
        default="http1",
        description=(
            "http mode only: the HTTP version spoken to the backend. h2 is HTTP/2, with prior knowledge "
            "(h2c) over scheme http and negotiated by ALPN over https, with trailers kept (gRPC). "
            "Defaults to http1."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.ca_secret_ref is not None and self.scheme != "https":
            raise ValueError("caSecretRef: caSecretRef requires scheme https")
        return self


_EXPOSE_RULES = (
    cel(
        "(self.mode != 'tcp') == (has(self.hosts) && size(self.hosts) > 0)",
        "hosts is required for modes http and tls and not allowed for mode tcp",
        ".hosts",
    ),
    cel(
        "!has(self.hosts) || self.mode != 'http' || (has(self.plaintext) && self.plaintext ?"
        " self.hosts.all(h, !has(h.tls)) : self.hosts.all(h, has(h.tls)))",
        "each host of an http expose needs tls, and a plaintext expose's hosts take none",
        ".hosts",
    ),
    cel(
        "!has(self.hosts) || self.mode != 'tls' || self.hosts.all(h, !has(h.tls) && !has(h.paths)"
        " && (!has(h.unmatchedPaths) || h.unmatchedPaths == 'Backend'))",
        "a tls expose's hosts are names only: the backend terminates TLS, so they take no tls, paths or "
        "unmatchedPaths",
        ".hosts",
    ),
    cel(
        "!has(self.plaintext) || !self.plaintext || self.mode == 'http'",
        "plaintext goes with mode http",
        ".plaintext",
    ),
    cel(
        "self.mode == 'http' || (self.backend.scheme == 'http' && !has(self.backend.caSecretRef)"
        " && self.backend.protocol == 'http1')",
        "backend.scheme https, backend.caSecretRef and backend.protocol h2 need mode http",
        ".backend",
    ),
)


class Expose(ApiModel):
    """One listener of the ingress node on the tailnet."""

    model_config = ConfigDict(json_schema_extra=validations(*_EXPOSE_RULES))

    name: DNSLabel = Field(description="Name of the expose, unique in this object.")
    mode: Literal["tcp", "http", "tls"] = Field(
        default="tcp",
        description=(
            "tcp forwards raw TCP; http terminates TLS with each host's certificate and proxies "
            "HTTP/1.1 and HTTP/2, routed by SNI; tls passes TLS through to the backend untouched, routed by "
            "the SNI of the client's ClientHello (the backend terminates it with its own certificate). "
            "Defaults to tcp."
        ),
    )
    port: Port = Field(description=(
        "Port the node listens on. http exposes may share one, and so may tls exposes (routed by SNI); a port "
        "carries exposes of one mode, and a tcp expose needs a port of its own."))
    backend: Backend = Field(description="Where traffic goes.")
    hosts: list[VirtualHost] | None = Field(
        default=None,
        max_length=HOSTS_MAX,
        description=(
            "http and tls modes only (and required there): the names this expose answers to. A ClientHello "
            "without SNI goes to a tls expose's * host, else is refused."),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    plaintext: bool = Field(
        default=False,
        description=(
            "http mode only: serve HTTP/1.1, and HTTP/2 with prior knowledge (h2c), without TLS (the tailnet's "
            "WireGuard encrypts it), each request's host picked by its Host header; the hosts take no tls. The "
            "exposes of one port are all plaintext or all TLS. Defaults to false."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        has_hosts = bool(self.hosts)
        if (self.mode != "tcp") != has_hosts:
            raise ValueError("hosts: hosts is required for modes http and tls and not allowed for mode tcp")
        if self.plaintext and self.mode != "http":
            raise ValueError("plaintext: plaintext goes with mode http")
        if self.mode == "http" and any((h.tls is None) != self.plaintext for h in self.hosts or []):
            raise ValueError("hosts: each host of an http expose needs tls, and a plaintext expose's hosts take none")
        if self.mode == "tls" and any(h.tls is not None or h.paths is not None or h.unmatched_paths != "Backend"
                                      for h in self.hosts or []):
            raise ValueError("hosts: a tls expose's hosts are names only: the backend terminates TLS, so they take "
                             "no tls, paths or unmatchedPaths")
        if self.mode != "http" and (self.backend.scheme != "http" or self.backend.ca_secret_ref is not None
                                    or self.backend.protocol != "http1"):
            raise ValueError(
                "backend: backend.scheme https, backend.caSecretRef and backend.protocol h2 need mode http")
        if self.hosts and (dups := duplicates([h.name for h in self.hosts])):
            raise ValueError(f"hosts: duplicate host {dups}")
        return self


_TEMPLATE_RULE = cel(
    "self.replace('{hostname}', 'h').replace('{name}', 'n').replace('{namespace}', 'ns')"
    f".matches({cel_string(DNS_SUBDOMAIN_PATTERN)})",
    "must expand to a DNS name; placeholders are {hostname}, {name} and {namespace}",
)


class TailnetIngressSpec(ApiModel):
    """Desired state of a TailnetIngress."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.exposes.all(e, self.exposes.all(f, e.name == f.name || e.port != f.port"
                " || (e.mode == f.mode && e.mode != 'tcp')))",
                "a port may be shared only by exposes of one mode, http or tls; a tcp expose needs a port of its own",
                ".exposes",
            ),
            cel(
                "self.exposes.all(e, self.exposes.all(f, e.port != f.port"
                " || (has(e.plaintext) && e.plaintext) == (has(f.plaintext) && f.plaintext)))",
                "the http exposes of one port are all plaintext or all TLS",
                ".exposes",
            ),
            cel(
                "self.exposes.all(e, !has(e.hosts) || e.hosts.all(h, self.exposes.all(f, e.name == f.name"
                " || !has(f.hosts) || f.hosts.all(g, g.name != h.name)"
                " || (e.port != f.port && (e.mode == 'tls' || f.mode == 'tls' || (has(e.plaintext) && e.plaintext)"
                " || (has(f.plaintext) && f.plaintext))))))",
                "a host name may appear in only one expose of a port, and in only one http expose with TLS "
                "(its certificate's)",
                ".exposes",
            ),
            cel(
                "!has(self.replicas) || self.replicas == 1 || has(self.sharedAddress)",
                "replicas above 1 need a sharedAddress: clients reach the replicas at that address, "
                "since a MagicDNS name belongs to one node",
                ".replicas",
            ),
        )
    )

    tailnet_ref: TailnetRef = Field(description="The Tailnet to join.")
    tag: Tag = Field(
        description=(
            "The ACL tag of this ingress node; the policy's grants for the tag decide who may reach it."
        )
    )
    hostname: DNSLabel = Field(description="Node name on the tailnet; its MagicDNS name is derived from it.")
    dns_template: str | None = Field(
        default=None,
        max_length=253,
        description=(
            "A DNS name under your zone for the node, with placeholders {hostname}, {name} and {namespace}, "
            "e.g. {hostname}.apps.example.internal; written to the Tailnet's DNS hosts file."
        ),
        json_schema_extra=validations(_TEMPLATE_RULE),
    )
    exposes: list[Expose] = Field(
        min_length=1,
        max_length=EXPOSES_MAX,
        description="Listeners on the tailnet and the Services behind them.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    shared_address: IPAddress | None = Field(
        default=None,
        description=(
            "An address the ingress's agent pods share, outside the tailnet's ranges (e.g. 198.18.5.10, from a "
            "range the Tailnet's tenants entry grants in sharedAddresses). Each pod advertises it as a host "
            "route, approved for the ingress's tag; Headscale sends it to one pod at a time and moves it when "
            "that pod goes, so rollouts, drains and lost pods keep it answering. The DNS names of the hosts file "
            "point at it. Clients must accept routes (tailscale up --accept-routes, the default off Linux) and "
            "the policy must grant them the address, as it grants the tag."
        ),
        json_schema_extra=validations(
            cel("!isIP(self) || !(cidr('100.64.0.0/10').containsIP(self) || "
                "cidr('fd7a:115c:a1e0::/48').containsIP(self))",
                "must be outside the tailnet's own ranges 100.64.0.0/10 and fd7a:115c:a1e0::/48"),
            cel("!isIP(self) || ip(self).isGlobalUnicast()", "must be a unicast address a peer can route to"),
        ),
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description=(
            "Number of agent Pods. Above 1 it needs sharedAddress: every Pod is its own node serving the "
            "address, with a PodDisruptionBudget (at most one evicted at a time) and spread over nodes, so a "
            f"drain or a lost Pod is answered by another. Defaults to 1; at most {MAX_REPLICAS}."
        ),
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if dups := duplicates([e.name for e in self.exposes]):
            raise ValueError(f"exposes: duplicate expose name {dups}")
        for e in self.exposes:
            for f in self.exposes:
                if e.name != f.name and e.port == f.port and not (e.mode == f.mode and e.mode != "tcp"):
                    raise ValueError(
                        "exposes: a port may be shared only by exposes of one mode, http or tls; "
                        "a tcp expose needs a port of its own"
                    )
        if any(e.port == f.port and e.plaintext != f.plaintext for e in self.exposes for f in self.exposes):
            raise ValueError("exposes: the http exposes of one port are all plaintext or all TLS")
        if dups := duplicates([*(f"{h.name} (port {e.port})" for e in self.exposes for h in e.hosts or []),
                               *(h.name for e in self.exposes if e.mode == "http" and not e.plaintext
                                 for h in e.hosts or [])]):
            raise ValueError(f"exposes: a host name may appear in only one expose of a port, and in only one http "
                             f"expose with TLS (its certificate's): {dups}")
        if self.replicas > 1 and self.shared_address is None:
            raise ValueError("replicas: replicas above 1 need a sharedAddress: clients reach the replicas at "
                             "that address, since a MagicDNS name belongs to one node")
        if self.shared_address is not None and (
                problem := shared_address_problem(ipaddress.ip_address(self.shared_address))) is not None:
            raise ValueError(f"sharedAddress: {self.shared_address} {problem}")
        if self.dns_template is not None:
            expanded = render_dns_template(self.dns_template, hostname="h", name="n", namespace="ns")
            if not re.fullmatch(DNS_SUBDOMAIN_PATTERN, expanded):
                raise ValueError("dnsTemplate: must expand to a DNS name")
        return self


class ExposeHostStatus(ApiModel):
    """One virtual host of an http or tls expose: its names and (http with TLS) its certificate."""

    name: str = Field(max_length=253, description="The host's DNS name.")
    alias: str | None = Field(default=None, max_length=63, description="The host's short alias.")
    alias_names: list[BoundedString] | None = Field(
        default=None, max_length=16, description="The alias under each of the Tailnet's DNS zones."
    )
    secret_name: str | None = Field(
        default=None, max_length=253, description="The TLS Secret the agent reads the certificate from."
    )
    certificate_not_after: Timestamp | None = Field(
        default=None, description="When the certificate the agent serves expires."
    )


class ExposeStatus(ApiModel):
    """Whether one expose serves traffic."""

    name: str = Field(max_length=63, description="Name of the expose.")
    ready: bool = Field(default=False, description="Whether the listener serves traffic. Defaults to false.")
    reason: str | None = Field(default=None, max_length=1024, description="CamelCase reason when not ready.")
    message: str | None = Field(default=None, max_length=1024, description="Details for people.")
    listening: bool | None = Field(default=None, description="Whether the agent's tailnet listener is bound.")
    backend_reachable: bool | None = Field(
        default=None, description="Whether the agent's last probe of the backend connected."
    )
    hosts: list[ExposeHostStatus] | None = Field(
        default=None, max_length=HOSTS_MAX, description="http and tls exposes: each virtual host."
    )


class TailnetIngressStatus(ApiModel):
    """Observed state of a TailnetIngress."""

    observed_generation: Generation | None = Field(
        default=None, description="The .metadata.generation the status was computed for."
    )
    conditions: Conditions | None = Field(default=None, description="Ready and more specific conditions.")
    node: NodeStatus | None = Field(default=None, description="The agent's tailnet node.")
    pre_auth_key: PreAuthKeyStatus | None = Field(default=None, description="The agent's pre-auth key.")
    magic_dns_name: str | None = Field(
        default=None, alias="magicDNSName", max_length=253, description="The node's MagicDNS name."
    )
    dns_names: list[BoundedString] | None = Field(
        default=None, alias="dnsNames", max_length=64, description="Names written to the DNS hosts file."
    )
    exposes: list[ExposeStatus] | None = Field(
        default=None,
        max_length=16,
        description="State of every expose.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class TailnetIngress(ApiModel):
    """Exposes in-cluster Services on the tailnet (namespaced)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailnet.dev/v1alpha1"] = "tailnet.dev/v1alpha1"
    kind: Literal["TailnetIngress"] = "TailnetIngress"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: TailnetIngressSpec
    status: TailnetIngressStatus | None = None
