"""The ingress exposes file (``TAILNET_EXPOSES_FILE``): pure parsing and writing, no I/O.

The operator writes it into the agent's ConfigMap (:func:`exposes_document`); the agent parses it
at startup and on every change (:func:`parse_exposes`). A JSON list, empty for a node with no
port open yet (a Gateway whose TLS and TCP listeners have no route); every problem is a
:class:`~tailnet_agent.contract.errors.ConfigError` naming the entry::

    [{"name": "db", "port": 5432, "backend": {"host": "db.shop.svc", "port": 5432}},
     {"name": "web", "port": 443, "mode": "http",
      "backend": {"host": "web.shop.svc", "port": 8443, "scheme": "https",
                  "caFile": "/etc/tailnet/ca/web/ca.crt", "serverName": "web.shop.svc"},
      "hosts": [{"name": "shop.example.com", "alias": "shop",
                 "tls": {"certFile": "/etc/tailnet/tls/shop/tls.crt",
                         "keyFile": "/etc/tailnet/tls/shop/tls.key"},
                 "routes": [{"path": "/api", "type": "Prefix",
                             "backend": {"host": "api.shop.svc", "port": 8080, "scheme": "http"}}]}]}]

* ``port``: the tailnet port the agent listens on. http exposes may share a port, and so may tls
  exposes (the host named in SNI chooses the expose; a name may then belong to one host of them
  only); a port carries exposes of one mode, and a tcp expose needs a port of its own.
* ``mode``: ``tcp`` (default; ``l4`` is the same) copies bytes both ways with half-close;
  ``http`` terminates TLS with the certificate of the host the client names in SNI and proxies
  HTTP/1.1 and HTTP/2 requests (:mod:`tailnet_agent.forward.http`); ``tls`` passes TLS through
  untouched, to the backend of the expose whose host the ClientHello's SNI names, and then copies
  bytes as tcp does (:mod:`tailnet_agent.forward.passthrough`).
* ``backend``: ``host`` (an in-cluster Service name or an IP) and ``port``. For http, ``scheme``
  ``http`` (default) or ``https``: HTTPS to the app is always verified, against ``caFile`` (PEM)
  when given, else the system roots, for ``serverName`` (default ``host``). ``protocol``
  ``http1`` (default) or ``h2``: HTTP/2 to the app, with prior knowledge (h2c) over ``http``, with
  ALPN ``h2`` over ``https``; trailers are kept (gRPC).
* ``hosts`` (http and tls, at least one): a virtual host's ``name``, an optional short ``alias``
  and optional further ``aliases`` (e.g. the alias under each DNS zone; all are accepted as SNI
  and Host), and (http only) ``tls.certFile``/``tls.keyFile`` (mounted PEM files,
  reloaded when they change). A name or alias belongs to one host of an expose. A tls expose's
  hosts are names only: no ``tls``, ``routes`` or ``fallback``.
* ``plaintext`` (http only, default false): HTTP/1.1, and HTTP/2 with prior knowledge (h2c),
  without TLS (the tailnet's WireGuard is the encryption); its hosts take no ``tls``, each request
  picks its host by Host (``:authority``) among the plaintext exposes of the port, and a host
  named ``*`` answers any other name. The exposes of one port are all plaintext or all TLS.
* ``routes`` of a host (http only): ``path`` and ``type`` (``Exact`` or ``Prefix``), optional
  ``method``, ``headers`` and ``query`` matches (exact values), and one of ``backend``,
  ``backends`` (each with a ``weight``) and ``redirect``; optional ``rewrite`` (``hostname``,
  ``path``) and ``requestHeaders``/``responseHeaders`` edits (``set``, ``add``, ``remove``).
  ``fallback`` (default true) says whether a request no route matches goes to the expose's
  backend or gets 404. How they are matched: :mod:`tailnet_agent.forward.http.routes`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from .environment import EXPOSES_FILE
from .errors import ConfigError
from .targets import PortMapping

__all__ = [
    "ANY_HOST",
    "EXACT",
    "H2",
    "HTTP",
    "HTTP1",
    "PREFIX",
    "REPLACE_FULL_PATH",
    "REPLACE_PREFIX_MATCH",
    "TCP",
    "TLS",
    "Backend",
    "Expose",
    "HeaderEdits",
    "Match",
    "PathChange",
    "Redirect",
    "Rewrite",
    "Route",
    "VirtualHost",
    "WeightedBackend",
    "closest",
    "exposes_document",
    "identity_named",
    "parse_exposes",
    "reserved_header",
]

NAME = EXPOSES_FILE
TCP = "tcp"
HTTP = "http"
TLS = "tls"
"""TLS passthrough: routed by the ClientHello's SNI, never terminated."""
HTTP1 = "http1"
H2 = "h2"
_MODES = {"tcp": TCP, "l4": TCP, "http": HTTP, "tls": TLS}
EXACT = "Exact"
PREFIX = "Prefix"
REPLACE_FULL_PATH = "ReplaceFullPath"
REPLACE_PREFIX_MATCH = "ReplacePrefixMatch"
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "http2-settings"})
"""Headers of one hop, never forwarded."""
FORWARDED = frozenset({"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "forwarded"})
"""The forwarding headers the agent writes itself."""
IDENTITY_PREFIXES = ("tailnet-", "tailscale-")
"""The identity namespace: headers the agent owns (``Tailnet-*``) and those backends written for
``tailscale serve`` trust (``Tailscale-*``). Any the client sends is dropped before the agent's own
are added."""
RESERVED_HEADERS = HOP_BY_HOP | FORWARDED | {"host", "content-length"}
"""Headers a route may not set, add or remove: the agent's own (Host goes by ``rewrite.hostname``;
hop-by-hop ones and the forwarding headers are the agent's to write). The identity namespace
(:func:`identity_named`) is refused too."""


def identity_named(name: str) -> bool:
    """``name`` is in the identity namespace as a backend may read it: lower-cased, with ``_`` read
    as ``-`` (CGI and WSGI servers turn both ``Tailnet-User-Login`` and ``Tailnet_User_Login`` into
    ``HTTP_TAILNET_USER_LOGIN``), it starts with ``tailnet-`` or ``tailscale-``."""
    return name.lower().replace("_", "-").startswith(IDENTITY_PREFIXES)


@dataclass(frozen=True, kw_only=True)
class Backend:
    host: str
    port: int
    scheme: str = "http"
    """``http`` or ``https`` (http exposes only)."""
    ca_file: str | None = None
    """PEM CAs that verify an https backend; None: the system roots."""
    server_name: str | None = None
    """The name an https backend's certificate must carry; None: ``host``."""
    protocol: str = HTTP1
    """``http1`` or ``h2`` (http exposes only): the HTTP version spoken to the backend."""

    def to_json(self, mode: str) -> dict[str, Any]:
        """The ``backend`` object; for tcp and tls only host and port, for http no key left at its
        default but ``scheme``."""
        out: dict[str, Any] = {"host": self.host, "port": self.port}
        if mode != HTTP:
            return out
        out["scheme"] = self.scheme
        if self.protocol != HTTP1:
            out["protocol"] = self.protocol
        if self.ca_file:
            out["caFile"] = self.ca_file
        if self.server_name:
            out["serverName"] = self.server_name
        return out


@dataclass(frozen=True, kw_only=True)
class Match:
    """One header or query parameter a request must carry with exactly this value (header names
    compared without case, query parameter names with it)."""

    name: str
    value: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value}


@dataclass(frozen=True, kw_only=True)
class WeightedBackend:
    """A backend of a route and its share of the route's requests (weight / the weights' sum)."""

    backend: Backend
    weight: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend.to_json(HTTP), "weight": self.weight}


@dataclass(frozen=True, kw_only=True)
class HeaderEdits:
    """Headers to set (replacing any of that name), add (beside them) and remove, in that order."""

    set: tuple[Match, ...] = ()
    add: tuple[Match, ...] = ()
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.set or self.add or self.remove)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.set:
            out["set"] = [m.to_json() for m in self.set]
        if self.add:
            out["add"] = [m.to_json() for m in self.add]
        if self.remove:
            out["remove"] = list(self.remove)
        return out


@dataclass(frozen=True, kw_only=True)
class PathChange:
    """A new path for a request: the whole path (``ReplaceFullPath``) or the part its ``Prefix``
    route matched (``ReplacePrefixMatch``)."""

    type: str
    value: str

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "value": self.value}


@dataclass(frozen=True, kw_only=True)
class Redirect:
    """The answer instead of a backend: a redirect to the same request with these parts changed
    (unset ones kept: the scheme https, the host the request named, the path and query)."""

    scheme: str | None = None
    hostname: str | None = None
    port: int | None = None
    path: PathChange | None = None
    status: int = 302

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"statusCode": self.status}
        for key, value in (("scheme", self.scheme), ("hostname", self.hostname), ("port", self.port)):
            if value is not None:
                out[key] = value
        if self.path is not None:
            out["path"] = self.path.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class Rewrite:
    """What the backend is sent instead of what the client asked: another host, another path."""

    hostname: str | None = None
    path: PathChange | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.hostname is not None:
            out["hostname"] = self.hostname
        if self.path is not None:
            out["path"] = self.path.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class Route:
    """One path of a host (with the method, headers and query it may further require) and where
    its requests go: one backend, several by weight, or a redirect."""

    path: str
    """Starts with ``/``; compared with the request's path without its query."""
    type: str = PREFIX
    """``Exact`` (the whole path) or ``Prefix`` (by path element: ``/foo`` matches ``/foo/bar``,
    never ``/foobar``)."""
    backend: Backend | None = None
    """The one backend (the Ingress's form); None with ``backends`` or ``redirect``."""
    backends: tuple[WeightedBackend, ...] = ()
    method: str | None = None
    headers: tuple[Match, ...] = ()
    query: tuple[Match, ...] = ()
    request_headers: HeaderEdits = HeaderEdits()
    response_headers: HeaderEdits = HeaderEdits()
    redirect: Redirect | None = None
    rewrite: Rewrite | None = None

    @property
    def weighted(self) -> tuple[WeightedBackend, ...]:
        """Every backend with its weight (``backend`` alone has weight 1)."""
        return self.backends or ((WeightedBackend(backend=self.backend),) if self.backend else ())

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.backend is not None:
            out["backend"] = self.backend.to_json(HTTP)
        if self.backends:
            out["backends"] = [b.to_json() for b in self.backends]
        if self.method:
            out["method"] = self.method
        if self.headers:
            out["headers"] = [m.to_json() for m in self.headers]
        if self.query:
            out["query"] = [m.to_json() for m in self.query]
        if self.request_headers:
            out["requestHeaders"] = self.request_headers.to_json()
        if self.response_headers:
            out["responseHeaders"] = self.response_headers.to_json()
        if self.redirect is not None:
            out["redirect"] = self.redirect.to_json()
        if self.rewrite is not None:
            out["rewrite"] = self.rewrite.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class VirtualHost:
    name: str
    alias: str | None = None
    aliases: tuple[str, ...] = ()
    """More names of the host, e.g. the alias under each of the tailnet's DNS zones."""
    cert_file: str = ""
    key_file: str = ""
    """The host's certificate and key (PEM files); empty on a plaintext expose."""
    routes: tuple[Route, ...] = ()
    """Path routing; empty: every request goes to the expose's backend."""
    fallback: bool = True
    """Where a request no route matches goes: the expose's backend (True) or nowhere, 404 (False).
    Without routes every request goes to the expose's backend, whatever this says."""

    @property
    def names(self) -> tuple[str, ...]:
        """What SNI and Host may say for this host."""
        return tuple(dict.fromkeys(n for n in (self.name, self.alias, *self.aliases) if n))

    def match(self, name: str) -> tuple[int, int] | None:
        """How closely this host answers to ``name`` (lower-case, no trailing dot), higher is
        closer: one of its names exactly; a ``*.`` name covering it (one or more labels before the
        suffix, the longer suffix closer); ``*``, any name. None when it does not answer."""
        if name in self.names:
            return (3, 0)
        if self.name == ANY_HOST:
            return (1, 0)
        if self.name.startswith("*.") and name.endswith(self.name[1:]) and len(name) > len(self.name) - 1:
            return (2, len(self.name))
        return None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.cert_file:
            out["tls"] = {"certFile": self.cert_file, "keyFile": self.key_file}
        if self.alias:
            out["alias"] = self.alias
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.routes:
            out["routes"] = [r.to_json() for r in self.routes]
        if not self.fallback:
            out["fallback"] = False
        return out


@dataclass(frozen=True, kw_only=True)
class Expose:
    name: str
    port: int
    """Tailnet port the agent listens on."""
    backend: Backend
    mode: str = TCP
    hosts: tuple[VirtualHost, ...] = ()
    plaintext: bool = False
    """http only: serve HTTP/1.1 and HTTP/2 with prior knowledge (h2c) without TLS (the tailnet's
    WireGuard is the encryption), the host chosen per request by Host among the port's plaintext
    exposes (``*`` any host)."""

    @property
    def address(self) -> str:
        return self.backend.host

    @property
    def ports(self) -> tuple[PortMapping, ...]:
        """One mapping: listen on the tailnet port, dial the backend's."""
        return (PortMapping(port=self.backend.port, listen=self.port),)

    def to_json(self) -> dict[str, Any]:
        """The entry as :func:`parse_exposes` reads it; a tcp expose leaves ``mode`` out."""
        out: dict[str, Any] = {"name": self.name, "port": self.port, "backend": self.backend.to_json(self.mode)}
        if self.mode != TCP:
            out["mode"] = self.mode
            out["hosts"] = [h.to_json() for h in self.hosts]
        if self.plaintext:
            out["plaintext"] = True
        return out


def exposes_document(exposes: Iterable[Expose]) -> str:
    """The file as the operator writes it, stable for equal input."""
    return json.dumps([e.to_json() for e in exposes], indent=1, sort_keys=True) + "\n"


def _port(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{NAME}: {where} must be a port number 1-65535, got {value!r}")
    return value


def _text(item: dict[str, Any], key: str, where: str, *, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{NAME}: {where}.{key} must be a non-empty string")
    return value.strip()


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{NAME}: {where} must be an object")
    return value


def _backend(raw: Any, where: str, mode: str) -> Backend:
    item = _object(raw, where)
    host = _text(item, "host", where)
    assert host is not None
    scheme = item.get("scheme", "http")
    if scheme not in ("http", "https") or (mode != HTTP and "scheme" in item):
        raise ConfigError(f"{NAME}: {where}.scheme must be http or https (http exposes only), got {scheme!r}")
    ca_file = _text(item, "caFile", where, required=False)
    server_name = _text(item, "serverName", where, required=False)
    if scheme == "http" and (ca_file or server_name):
        raise ConfigError(f"{NAME}: {where}: caFile and serverName go with scheme https")
    protocol = item.get("protocol", HTTP1)
    if protocol not in (HTTP1, H2) or (mode != HTTP and "protocol" in item):
        raise ConfigError(f"{NAME}: {where}.protocol must be http1 or h2 (http exposes only), got {protocol!r}")
    return Backend(host=host, port=_port(item.get("port"), f"{where}.port"), scheme=scheme, ca_file=ca_file,
                   server_name=server_name, protocol=protocol)


ANY_HOST = "*"
"""A host that answers to any name no other host of the port answers to (:meth:`VirtualHost.match`)."""


T = TypeVar("T")


def closest(candidates: Iterable[tuple[T, VirtualHost]], name: str) -> tuple[T, VirtualHost] | None:
    """The first of ``candidates`` (what serves it, a host) whose host answers to ``name`` most
    closely (:meth:`VirtualHost.match`): an exact name before a ``*.`` name, before ``*``."""
    best: tuple[T, VirtualHost] | None = None
    rank: tuple[int, int] | None = None
    for candidate in candidates:
        found = candidate[1].match(name)
        if found is not None and (rank is None or found > rank):
            best, rank = candidate, found
    return best


def _host(raw: Any, where: str, *, plaintext: bool = False, passthrough: bool = False) -> VirtualHost:
    """A host of an http expose, or (``passthrough``) a tls expose's: a name and aliases only."""
    item = _object(raw, where)
    if passthrough and (given := [k for k in ("tls", "routes", "fallback") if k in item]):
        raise ConfigError(f"{NAME}: {where}: a tls expose's host is names only, it takes no {', '.join(given)}")
    name = _text(item, "name", where)
    alias = _text(item, "alias", where, required=False)
    raw_aliases = item.get("aliases", [])
    if not isinstance(raw_aliases, list) or not all(isinstance(a, str) and a.strip() for a in raw_aliases):
        raise ConfigError(f"{NAME}: {where}.aliases must be a list of non-empty strings")
    assert name is not None
    cert = key = ""
    if plaintext or passthrough:
        if "tls" in item:
            raise ConfigError(f"{NAME}: {where}: a plaintext expose's host takes no tls")
    else:
        tls = _object(item.get("tls"), f"{where}.tls")
        cert, key = _text(tls, "certFile", f"{where}.tls") or "", _text(tls, "keyFile", f"{where}.tls") or ""
    raw_routes = item.get("routes", [])
    if not isinstance(raw_routes, list):
        raise ConfigError(f"{NAME}: {where}.routes must be a list")
    fallback = item.get("fallback", True)
    if not isinstance(fallback, bool):
        raise ConfigError(f"{NAME}: {where}.fallback must be true or false, got {fallback!r}")
    return VirtualHost(name=name.lower().rstrip("."), alias=alias.lower().rstrip(".") if alias else None,
                       aliases=tuple(a.strip().lower().rstrip(".") for a in raw_aliases),
                       cert_file=cert, key_file=key,
                       routes=tuple(_route(r, f"{where}.routes[{k}]") for k, r in enumerate(raw_routes)),
                       fallback=fallback)


def _route(raw: Any, where: str) -> Route:
    item = _object(raw, where)
    path = item.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise ConfigError(f"{NAME}: {where}.path must be a string starting with /, got {path!r}")
    kind = item.get("type", PREFIX)
    if kind not in (EXACT, PREFIX):
        raise ConfigError(f"{NAME}: {where}.type must be Exact or Prefix, got {kind!r}")
    method = item.get("method")
    if method is not None and method not in METHODS:
        raise ConfigError(f"{NAME}: {where}.method must be one of {', '.join(METHODS)}, got {method!r}")
    targets = [k for k in ("backend", "backends", "redirect") if k in item]
    if len(targets) != 1:
        raise ConfigError(f"{NAME}: {where} needs exactly one of backend, backends and redirect, got "
                          f"{', '.join(targets) or 'none'}")
    backends = tuple(_weighted(b, f"{where}.backends[{k}]") for k, b in enumerate(_list(item, "backends", where)))
    if "backends" in item and not backends:
        raise ConfigError(f"{NAME}: {where}.backends must not be empty")
    redirect = _redirect(item["redirect"], f"{where}.redirect", kind) if "redirect" in item else None
    rewrite = _rewrite(item["rewrite"], f"{where}.rewrite", kind) if "rewrite" in item else None
    if redirect is not None and (rewrite is not None or "requestHeaders" in item):
        raise ConfigError(f"{NAME}: {where}: a redirect goes to no backend, so it takes no rewrite or requestHeaders")
    return Route(path=path, type=kind, method=method,
                 backend=_backend(item["backend"], f"{where}.backend", HTTP) if "backend" in item else None,
                 backends=backends,
                 headers=_matches(item, "headers", where, fold=True), query=_matches(item, "query", where, fold=False),
                 request_headers=_edits(item.get("requestHeaders"), f"{where}.requestHeaders"),
                 response_headers=_edits(item.get("responseHeaders"), f"{where}.responseHeaders"),
                 redirect=redirect, rewrite=rewrite)


def _list(item: dict[str, Any], key: str, where: str) -> list[Any]:
    value = item.get(key, [])
    if not isinstance(value, list):
        raise ConfigError(f"{NAME}: {where}.{key} must be a list")
    return value


def _match(raw: Any, where: str) -> Match:
    item = _object(raw, where)
    if item.get("type", EXACT) != EXACT:
        raise ConfigError(f"{NAME}: {where}.type must be Exact (regular expressions are not supported), "
                          f"got {item.get('type')!r}")
    name, value = _text(item, "name", where), item.get("value")
    if not isinstance(value, str):
        raise ConfigError(f"{NAME}: {where}.value must be a string")
    assert name is not None
    return Match(name=name, value=value)


def _matches(item: dict[str, Any], key: str, where: str, *, fold: bool) -> tuple[Match, ...]:
    """A route's header (``fold``: names without case) or query matches; a name given twice is
    refused, as only one value of a name can be required."""
    out = tuple(_match(m, f"{where}.{key}[{k}]") for k, m in enumerate(_list(item, key, where)))
    names = [m.name.lower() if fold else m.name for m in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{NAME}: {where}.{key} names a {'header' if fold else 'parameter'} twice")
    return out


def _weighted(raw: Any, where: str) -> WeightedBackend:
    item = _object(raw, where)
    weight = item.get("weight", 1)
    if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 1_000_000:
        raise ConfigError(f"{NAME}: {where}.weight must be a whole number 0-1000000, got {weight!r}")
    return WeightedBackend(backend=_backend(item.get("backend"), f"{where}.backend", HTTP), weight=weight)


def reserved_header(name: str) -> bool:
    """A header a route may not set, add or remove (:data:`RESERVED_HEADERS`, the identity namespace)."""
    return name.lower() in RESERVED_HEADERS or identity_named(name)


RESERVED_HEADER_TEXT = ("is the agent's to write (hop-by-hop, forwarding, Host or the caller's identity), "
                        "never a route's")


def _edited_name(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw.strip() or any(c in raw for c in ": \t\r\n"):
        raise ConfigError(f"{NAME}: {where} must be a header name, got {raw!r}")
    if reserved_header(raw):
        raise ConfigError(f"{NAME}: {where}: {raw} {RESERVED_HEADER_TEXT}")
    return raw


def _edits(raw: Any, where: str) -> HeaderEdits:
    if raw is None:
        return HeaderEdits()
    item = _object(raw, where)
    pairs: dict[str, tuple[Match, ...]] = {}
    for key in ("set", "add"):
        entries = []
        for k, entry in enumerate(_list(item, key, where)):
            match = _match(entry, f"{where}.{key}[{k}]")
            entries.append(Match(name=_edited_name(match.name, f"{where}.{key}[{k}].name"), value=match.value))
        pairs[key] = tuple(entries)
    remove = tuple(_edited_name(n, f"{where}.remove[{k}]") for k, n in enumerate(_list(item, "remove", where)))
    return HeaderEdits(set=pairs["set"], add=pairs["add"], remove=remove)


def _path_change(raw: Any, where: str, kind: str) -> PathChange:
    item = _object(raw, where)
    change, value = item.get("type"), item.get("value")
    if change not in (REPLACE_FULL_PATH, REPLACE_PREFIX_MATCH):
        raise ConfigError(f"{NAME}: {where}.type must be ReplaceFullPath or ReplacePrefixMatch, got {change!r}")
    if change == REPLACE_PREFIX_MATCH and kind != PREFIX:
        raise ConfigError(f"{NAME}: {where}: ReplacePrefixMatch goes with a Prefix route only")
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"{NAME}: {where}.value must be a path starting with /, got {value!r}")
    return PathChange(type=change, value=value)


def _hostname(item: dict[str, Any], where: str) -> str | None:
    name = _text(item, "hostname", where, required=False)
    if name is not None and any(c in name for c in "/?#@ :"):
        raise ConfigError(f"{NAME}: {where}.hostname must be a host name, got {name!r}")
    return name.lower().rstrip(".") if name else None


def _redirect(raw: Any, where: str, kind: str) -> Redirect:
    item = _object(raw, where)
    scheme = item.get("scheme")
    if scheme not in (None, "http", "https"):
        raise ConfigError(f"{NAME}: {where}.scheme must be http or https, got {scheme!r}")
    status = item.get("statusCode", 302)
    if status not in REDIRECT_STATUSES:
        raise ConfigError(f"{NAME}: {where}.statusCode must be one of {REDIRECT_STATUSES}, got {status!r}")
    return Redirect(scheme=scheme, hostname=_hostname(item, where), status=status,
                    port=_port(item["port"], f"{where}.port") if "port" in item else None,
                    path=_path_change(item["path"], f"{where}.path", kind) if "path" in item else None)


def _rewrite(raw: Any, where: str, kind: str) -> Rewrite:
    item = _object(raw, where)
    return Rewrite(hostname=_hostname(item, where),
                   path=_path_change(item["path"], f"{where}.path", kind) if "path" in item else None)


def parse_exposes(text: str) -> tuple[Expose, ...]:
    """Parse the exposes JSON (shape in the module docstring); an empty list opens no port."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{NAME} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, list):
        raise ConfigError(f"{NAME} must be a JSON list of exposes")
    exposes: list[Expose] = []
    ports: dict[int, Expose] = {}
    names: dict[tuple[int, str], str] = {}
    """(port, SNI name) -> the expose that answers to it."""
    for i, raw in enumerate(doc):
        item = _object(raw, f"[{i}]")
        label = _text(item, "name", f"[{i}]")
        assert label is not None
        where = f"[{i}] ({label})"
        if any(e.name == label for e in exposes):
            raise ConfigError(f"{NAME}: {where}: the name is used twice")
        mode = _MODES.get(item.get("mode", TCP))
        if mode is None:
            raise ConfigError(f"{NAME}: {where}.mode must be tcp, http or tls, got {item.get('mode')!r}")
        port = _port(item.get("port"), f"{where}.port")
        if (other := ports.get(port)) is not None and (mode != other.mode or mode == TCP):
            raise ConfigError(f"{NAME}: port {port} is used by both {other.name} ({other.mode}) and {label} "
                              f"({mode}); a port is shared only by exposes of one mode, http or tls")
        backend = _backend(item.get("backend"), f"{where}.backend", mode)
        raw_hosts = item.get("hosts", [])
        if mode == TCP and raw_hosts:
            raise ConfigError(f"{NAME}: {where}: hosts go with mode http or tls")
        if mode != TCP and (not isinstance(raw_hosts, list) or not raw_hosts):
            raise ConfigError(f"{NAME}: {where}.hosts must be a non-empty list for mode {mode}")
        plaintext = item.get("plaintext", False)
        if not isinstance(plaintext, bool) or (plaintext and mode != HTTP):
            raise ConfigError(f"{NAME}: {where}.plaintext must be true or false, and goes with mode http")
        if other is not None and other.mode == HTTP and other.plaintext != plaintext:
            raise ConfigError(f"{NAME}: port {port} is used by both {other.name} and {label}, one with TLS and one "
                              "without; the exposes of one port are all plaintext or all TLS")
        hosts = tuple(_host(h, f"{where}.hosts[{j}]", plaintext=plaintext, passthrough=mode == TLS)
                      for j, h in enumerate(raw_hosts))
        seen: set[str] = set()
        for host in hosts:
            for name in host.names:
                if name in seen:
                    raise ConfigError(f"{NAME}: {where}: {name} names two hosts")
                seen.add(name)
                if (owner := names.get((port, name))) is not None:
                    raise ConfigError(f"{NAME}: {where}: {name} is a host of {owner} too, on the same port {port}")
                names[(port, name)] = label
        expose = Expose(name=label, port=port, backend=backend, mode=mode, hosts=hosts, plaintext=plaintext)
        ports.setdefault(port, expose)
        exposes.append(expose)
    return tuple(exposes)
