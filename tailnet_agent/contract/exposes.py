"""The ingress exposes file (``TAILNET_EXPOSES_FILE``): pure parsing and writing, no I/O.

The operator writes it into the agent's ConfigMap (:func:`exposes_document`); the agent parses it
at startup and on every change (:func:`parse_exposes`). A JSON list; every problem is a
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

* ``port``: the tailnet port the agent listens on. http exposes may share a port (the host named
  in SNI chooses the expose; a name may then belong to one host of them only); a tcp expose
  needs a port of its own.
* ``mode``: ``tcp`` (default; ``l4`` is the same) copies bytes both ways with half-close;
  ``http`` terminates TLS with the certificate of the host the client names in SNI and proxies
  HTTP/1.1 and HTTP/2 requests (:mod:`tailnet_agent.forward.http`).
* ``backend``: ``host`` (an in-cluster Service name or an IP) and ``port``. For http, ``scheme``
  ``http`` (default) or ``https``: HTTPS to the app is always verified, against ``caFile`` (PEM)
  when given, else the system roots, for ``serverName`` (default ``host``). ``protocol``
  ``http1`` (default) or ``h2``: HTTP/2 to the app, with prior knowledge (h2c) over ``http``, with
  ALPN ``h2`` over ``https``; trailers are kept (gRPC).
* ``hosts`` (http only, at least one): a virtual host's ``name``, an optional short ``alias``
  and optional further ``aliases`` (e.g. the alias under each DNS zone; all are accepted as SNI
  and Host), and ``tls.certFile``/``tls.keyFile`` (mounted PEM files,
  reloaded when they change). A name or alias belongs to one host of an expose.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .environment import EXPOSES_FILE
from .errors import ConfigError
from .targets import PortMapping

__all__ = ["EXACT", "H2", "HTTP", "HTTP1", "PREFIX", "TCP", "Backend", "Expose", "Route", "VirtualHost",
           "exposes_document", "parse_exposes"]

NAME = EXPOSES_FILE
TCP = "tcp"
HTTP = "http"
HTTP1 = "http1"
H2 = "h2"
_MODES = {"tcp": TCP, "l4": TCP, "http": HTTP}
EXACT = "Exact"
PREFIX = "Prefix"


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
        """The ``backend`` object; for tcp only host and port, for http no key left at its default
        but ``scheme``."""
        out: dict[str, Any] = {"host": self.host, "port": self.port}
        if mode == TCP:
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
class Route:
    """One path of a host and the backend its requests go to."""

    path: str
    """Starts with ``/``; compared with the request's path without its query."""
    type: str = PREFIX
    """``Exact`` (the whole path) or ``Prefix`` (by path element: ``/foo`` matches ``/foo/bar``,
    never ``/foobar``)."""
    backend: Backend

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "type": self.type, "backend": self.backend.to_json(HTTP)}


@dataclass(frozen=True, kw_only=True)
class VirtualHost:
    name: str
    alias: str | None = None
    aliases: tuple[str, ...] = ()
    """More names of the host, e.g. the alias under each of the tailnet's DNS zones."""
    cert_file: str
    key_file: str
    routes: tuple[Route, ...] = ()
    """Path routing; empty: every request goes to the expose's backend."""
    fallback: bool = True
    """Where a request no route matches goes: the expose's backend (True) or nowhere, 404 (False).
    Without routes every request goes to the expose's backend, whatever this says."""

    @property
    def names(self) -> tuple[str, ...]:
        """What SNI and Host may say for this host."""
        return tuple(dict.fromkeys(n for n in (self.name, self.alias, *self.aliases) if n))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "tls": {"certFile": self.cert_file, "keyFile": self.key_file}}
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
    if scheme not in ("http", "https") or (mode == TCP and "scheme" in item):
        raise ConfigError(f"{NAME}: {where}.scheme must be http or https (http exposes only), got {scheme!r}")
    ca_file = _text(item, "caFile", where, required=False)
    server_name = _text(item, "serverName", where, required=False)
    if scheme == "http" and (ca_file or server_name):
        raise ConfigError(f"{NAME}: {where}: caFile and serverName go with scheme https")
    protocol = item.get("protocol", HTTP1)
    if protocol not in (HTTP1, H2) or (mode == TCP and "protocol" in item):
        raise ConfigError(f"{NAME}: {where}.protocol must be http1 or h2 (http exposes only), got {protocol!r}")
    return Backend(host=host, port=_port(item.get("port"), f"{where}.port"), scheme=scheme, ca_file=ca_file,
                   server_name=server_name, protocol=protocol)


def _host(raw: Any, where: str) -> VirtualHost:
    item = _object(raw, where)
    name = _text(item, "name", where)
    alias = _text(item, "alias", where, required=False)
    raw_aliases = item.get("aliases", [])
    if not isinstance(raw_aliases, list) or not all(isinstance(a, str) and a.strip() for a in raw_aliases):
        raise ConfigError(f"{NAME}: {where}.aliases must be a list of non-empty strings")
    tls = _object(item.get("tls"), f"{where}.tls")
    cert, key = _text(tls, "certFile", f"{where}.tls"), _text(tls, "keyFile", f"{where}.tls")
    assert name is not None and cert is not None and key is not None
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
    return Route(path=path, type=kind, backend=_backend(item.get("backend"), f"{where}.backend", HTTP))


def parse_exposes(text: str) -> tuple[Expose, ...]:
    """Parse the exposes JSON (shape in the module docstring); an empty list is refused."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{NAME} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, list) or not doc:
        raise ConfigError(f"{NAME} must be a non-empty JSON list of exposes")
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
            raise ConfigError(f"{NAME}: {where}.mode must be tcp or http, got {item.get('mode')!r}")
        port = _port(item.get("port"), f"{where}.port")
        if (other := ports.get(port)) is not None and TCP in (mode, other.mode):
            raise ConfigError(f"{NAME}: port {port} is used by both {other.name} and {label}; only http exposes "
                              "may share a port")
        backend = _backend(item.get("backend"), f"{where}.backend", mode)
        raw_hosts = item.get("hosts", [])
        if mode == TCP and raw_hosts:
            raise ConfigError(f"{NAME}: {where}: hosts go with mode http")
        if mode == HTTP and (not isinstance(raw_hosts, list) or not raw_hosts):
            raise ConfigError(f"{NAME}: {where}.hosts must be a non-empty list for mode http")
        hosts = tuple(_host(h, f"{where}.hosts[{j}]") for j, h in enumerate(raw_hosts))
        seen: set[str] = set()
        for host in hosts:
            for name in host.names:
                if name in seen:
                    raise ConfigError(f"{NAME}: {where}: {name} names two hosts")
                seen.add(name)
                if (owner := names.get((port, name))) is not None:
                    raise ConfigError(f"{NAME}: {where}: {name} is a host of {owner} too, on the same port {port}")
                names[(port, name)] = label
        expose = Expose(name=label, port=port, backend=backend, mode=mode, hosts=hosts)
        ports.setdefault(port, expose)
        exposes.append(expose)
    return tuple(exposes)
