"""The agent's configuration, read once at startup from the environment and mounted files.

Every problem is a :class:`ConfigError` with a one-line message naming the variable. Variables:

=============================  ======================================================================
``TAILNET_CONTROL_URL``        Headscale URL (``https://...``). Required.
``TAILNET_AUTH_KEY_FILE``      File holding the pre-auth key (the operator mounts a Secret). Required.
                               The key is never logged or shown in ``repr``. Read again when control
                               refuses the key (for up to 180 s, until it holds another key).
``TAILNET_HOSTNAME``           Node hostname on the tailnet. Required.
``TAILNET_CA_BUNDLE``          PEM file of CAs trusted for control and DERP TLS. Unset: system store.
``TAILNET_TARGETS``            Egress targets as JSON. Required for egress.
``TAILNET_TARGETS_FILE``       The same JSON read from a file; used when ``TAILNET_TARGETS`` is unset.
                               The file is followed: a change applies without a restart.
``TAILNET_EXPOSES_FILE``       Ingress exposes as JSON (:mod:`tailnet_agent.contract.exposes`). Required for
                               ingress; followed like the targets file.
``TAILNET_BIND_ADDRESS``       Address the egress listeners bind. Default ``0.0.0.0``.
``TAILNET_HEALTH_ADDRESS``     ``host:port`` of /healthz, /readyz and /metrics. Default ``0.0.0.0:9002``.
``TAILNET_ACCEPT_ROUTES``      Use peers' subnet routes (``true``/``false``). Default true for egress.
``TAILNET_DIAL_TIMEOUT``       Seconds a tailnet dial may take. Default 30.
``TAILNET_UDP_PORT``           UDP port for direct paths to peers (disco and WireGuard), ``0`` for any
                               free port, ``off`` for DERP only. Default 41641 (tailscaled's).
``TAILNET_MAX_CONNECTIONS``    Client connections open at once, all listeners. Default 4096; ``0``:
                               no limit. One more is closed as it is accepted.
``TAILNET_MAX_CONNECTIONS_PER_PEER``
                               Client connections open at once from one source address (ingress: the
                               tailnet peer; egress: the client pod). Default 512; ``0``: no limit.
``TAILNET_HTTP1_MAX_LINE_SIZE``
                               Bytes of an HTTP/1.1 request line (ingress http). Default 8190; over
                               it: 431.
``TAILNET_HTTP1_MAX_FIELD_SIZE``
                               Bytes of one HTTP/1.1 header field. Default 8190; over it: 431.
``TAILNET_HTTP2_MAX_HEADER_LIST_SIZE``
                               HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE (RFC 9113 6.5.2). Default 65536;
                               over it: 431, over twice it: GOAWAY ENHANCE_YOUR_CALM.
``TAILNET_HTTP2_MAX_STREAMS``  HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS (ingress http). Default 100.
``TAILNET_HTTP2_MAX_RESETS``   Streams an HTTP/2 client may reset per 10 s before GOAWAY
                               ENHANCE_YOUR_CALM (rapid reset). Default 200; ``0``: no limit.
``TAILNET_IDLE_TIMEOUT``       Seconds an HTTP connection with no request in progress stays open.
                               Default 120; ``0``: no timeout.
``TAILNET_DRAIN_TIMEOUT``      Seconds the open connections get to finish after SIGTERM (readiness is
                               false; the listeners close once clients have stopped coming, see
                               ``tailnet_agent/handover.py``), before the rest are reset and the node
                               logs out. Default 20 (below Kubernetes' default
                               grace period of 30 s, leaving room for the logout); ``0``: none.
``TAILNET_SHARED_ADDRESS``     Ingress only: the address the ingress's replicas share, one IPv4 and/or
                               one IPv6 address (comma-separated), outside the tailnet's own ranges.
                               Each replica advertises it as a /32 (/128) route and answers on it;
                               control sends it to one replica at a time and moves it when that one
                               goes. At SIGTERM the replica withdraws the route first and keeps
                               accepting until control has moved it. Unset: none.
=============================  ======================================================================

The limits are :class:`tailnet_agent.limits.Limits`' (each one's meaning is documented there).

The targets and exposes files are the contract's (:mod:`tailnet_agent.contract.targets`,
:mod:`tailnet_agent.contract.exposes`); the variable names are :mod:`tailnet_agent.contract.environment`'s.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from tailnet_agent.contract import environment as env_names
from tailnet_agent.contract.addresses import shared_address_problem
from tailnet_agent.contract.endpoints import DEFAULT_HEALTH_ADDRESS, HEALTH_PORT
from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.contract.exposes import Expose, parse_exposes
from tailnet_agent.contract.targets import PortMapping, Target, parse_targets
from tailnet_agent.limits import (
    DEFAULT_HTTP1_MAX_FIELD_SIZE,
    DEFAULT_HTTP1_MAX_LINE_SIZE,
    DEFAULT_HTTP2_MAX_HEADER_LIST_SIZE,
    DEFAULT_HTTP2_MAX_RESETS,
    DEFAULT_HTTP2_MAX_STREAMS,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    Limits,
)

DEFAULT_BIND_ADDRESS = "0.0.0.0"
DEFAULT_DIAL_TIMEOUT = 30.0
DEFAULT_UDP_PORT = 41641
DEFAULT_DRAIN_TIMEOUT = 20.0
MIN_HEADER_SIZE = 256
"""The smallest header size limit accepted: below it no ordinary request fits (a typo, not a limit)."""
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class Forwarded(Protocol):
    """What a forwarder listens for and dials: a :class:`Target`, or an ingress expose
    (:class:`tailnet_agent.contract.exposes.Expose`); each ``PortMapping`` is a listen port and the port dialled."""

    @property
    def name(self) -> str: ...

    @property
    def address(self) -> str: ...

    @property
    def ports(self) -> tuple[PortMapping, ...]: ...


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    control_url: str
    auth_key: str = field(repr=False)
    """The pre-auth key read from ``TAILNET_AUTH_KEY_FILE``; never logged."""
    auth_key_file: Path | None = None
    """``TAILNET_AUTH_KEY_FILE``, read again when control refuses the key."""
    hostname: str
    ca_bundle: Path | None = None
    targets: tuple[Target, ...] = ()
    targets_file: Path | None = None
    """Where the targets came from when read from ``TAILNET_TARGETS_FILE`` (followed for changes)."""
    targets_digest: str = ""
    """SHA-256 of the targets (or exposes) file's bytes as read at startup."""
    exposes: tuple[Expose, ...] = ()
    exposes_file: Path | None = None
    bind_address: str = DEFAULT_BIND_ADDRESS
    health_host: str = "0.0.0.0"
    health_port: int = HEALTH_PORT
    accept_routes: bool = True
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT
    """Seconds; a dial without a SYN-ACK by then fails as timed out."""
    udp_port: int | None = DEFAULT_UDP_PORT
    """UDP port for direct paths; 0 any; None: DERP only."""
    limits: Limits = field(default_factory=Limits)
    """What clients may hold (connections, HTTP/2 streams and resets, idle time)."""
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    """Seconds the open connections get to finish after SIGTERM. Default 20; 0: none."""
    shared_addresses: tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...] = ()
    """``TAILNET_SHARED_ADDRESS``: addresses advertised as host routes and answered as the node's own."""


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set")
    return value


def parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def parse_host_port(name: str, value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name} must be host:port, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _read_file(name: str, path: str) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None


def load(env: Mapping[str, str] | None = None, *, mode: str = env_names.EGRESS) -> AgentConfig:
    """Build the configuration from ``env`` (default ``os.environ``) for ``mode``."""
    env = os.environ if env is None else env
    url = _required(env, env_names.CONTROL_URL)
    parsed = urlparse(url)
    if parsed.scheme not in ("https", "http") or not parsed.netloc:
        raise ConfigError(f"{env_names.CONTROL_URL} must be an http(s) URL, got {url!r}")
    key_file = _required(env, env_names.AUTH_KEY_FILE)
    auth_key = _read_file(env_names.AUTH_KEY_FILE, key_file).strip()
    if not auth_key:
        raise ConfigError(f"{env_names.AUTH_KEY_FILE}: {key_file} is empty")
    hostname = _required(env, env_names.HOSTNAME)
    ca_bundle: Path | None = None
    if ca := env.get(env_names.CA_BUNDLE, "").strip():
        ca_bundle = Path(ca)
        if not ca_bundle.is_file():
            raise ConfigError(f"{env_names.CA_BUNDLE}: {ca} is not a file")
    targets: tuple[Target, ...] = ()
    targets_file: Path | None = None
    targets_digest = ""
    if mode == env_names.EGRESS:
        if text := env.get(env_names.TARGETS, "").strip():
            targets = parse_targets(text)
        elif path := env.get(env_names.TARGETS_FILE, "").strip():
            text = _read_file(env_names.TARGETS_FILE, path)
            targets = parse_targets(text, name=env_names.TARGETS_FILE)
            targets_file, targets_digest = Path(path), hashlib.sha256(text.encode()).hexdigest()
        else:
            raise ConfigError(f"{env_names.TARGETS} is not set (egress needs at least one target)")
        if not targets:
            raise ConfigError(f"{env_names.TARGETS} is empty (egress needs at least one target)")
    exposes: tuple[Expose, ...] = ()
    exposes_file: Path | None = None
    if mode == env_names.INGRESS:
        path = _required(env, env_names.EXPOSES_FILE)
        text = _read_file(env_names.EXPOSES_FILE, path)
        exposes = parse_exposes(text)
        exposes_file, targets_digest = Path(path), hashlib.sha256(text.encode()).hexdigest()
    bind = env.get(env_names.BIND_ADDRESS, "").strip() or DEFAULT_BIND_ADDRESS
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise ConfigError(f"{env_names.BIND_ADDRESS} must be an IP address, got {bind!r}") from None
    health_host, health_port = parse_host_port(
        env_names.HEALTH_ADDRESS, env.get(env_names.HEALTH_ADDRESS, "").strip() or DEFAULT_HEALTH_ADDRESS)
    shared = env.get(env_names.SHARED_ADDRESS, "").strip()
    if shared and mode != env_names.INGRESS:
        raise ConfigError(f"{env_names.SHARED_ADDRESS} is for ingress agents only")
    accept = env.get(env_names.ACCEPT_ROUTES, "").strip()
    accept_routes = parse_bool(env_names.ACCEPT_ROUTES, accept) if accept else mode == env_names.EGRESS
    timeout_text = env.get(env_names.DIAL_TIMEOUT, "").strip()
    dial_timeout = DEFAULT_DIAL_TIMEOUT
    if timeout_text:
        try:
            dial_timeout = float(timeout_text)
        except ValueError:
            raise ConfigError(f"{env_names.DIAL_TIMEOUT} must be seconds, got {timeout_text!r}") from None
        if not dial_timeout > 0:
            raise ConfigError(f"{env_names.DIAL_TIMEOUT} must be positive, got {timeout_text!r}")
    return AgentConfig(control_url=url, auth_key=auth_key, auth_key_file=Path(key_file), hostname=hostname,
                       ca_bundle=ca_bundle,
                       targets=targets, targets_file=targets_file, targets_digest=targets_digest,
                       exposes=exposes, exposes_file=exposes_file,
                       bind_address=bind, health_host=health_host, health_port=health_port,
                       accept_routes=accept_routes, dial_timeout=dial_timeout, udp_port=parse_udp_port(env),
                       limits=parse_limits(env),
                       drain_timeout=_number(env, env_names.DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, integer=False),
                       shared_addresses=parse_shared_addresses(shared))


def parse_shared_addresses(value: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    """``TAILNET_SHARED_ADDRESS``: at most one IPv4 and one IPv6 address, each one that may be shared."""
    name = env_names.SHARED_ADDRESS
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for text in filter(None, (part.strip() for part in value.split(","))):
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            raise ConfigError(f"{name} must be IP addresses, got {text!r}") from None
        if (problem := shared_address_problem(address)) is not None:
            raise ConfigError(f"{name}: {address} {problem}")
        if any(a.version == address.version for a in found):
            raise ConfigError(f"{name}: at most one IPv4 and one IPv6 address, got {value!r}")
        found.append(address)
    return tuple(found)


def _number(env: Mapping[str, str], name: str, default: float, *, integer: bool, minimum: float = 0) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise ConfigError(f"{name} must be {'a whole number' if integer else 'seconds'}, got {text!r}") from None
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum:g}, got {text!r}")
    return value


def parse_limits(env: Mapping[str, str]) -> Limits:
    """The limits' variables (``TAILNET_MAX_CONNECTIONS`` and the others in the table above;
    unset: :class:`Limits`' defaults)."""
    def whole(name: str, default: int, minimum: int = 0) -> int:
        return int(_number(env, name, default, integer=True, minimum=minimum))

    return Limits(
        max_connections=whole(env_names.MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS),
        max_connections_per_peer=whole(env_names.MAX_CONNECTIONS_PER_PEER, DEFAULT_MAX_CONNECTIONS_PER_PEER),
        http1_max_line_size=whole(env_names.HTTP1_MAX_LINE_SIZE, DEFAULT_HTTP1_MAX_LINE_SIZE, MIN_HEADER_SIZE),
        http1_max_field_size=whole(env_names.HTTP1_MAX_FIELD_SIZE, DEFAULT_HTTP1_MAX_FIELD_SIZE, MIN_HEADER_SIZE),
        http2_max_header_list_size=whole(env_names.HTTP2_MAX_HEADER_LIST_SIZE, DEFAULT_HTTP2_MAX_HEADER_LIST_SIZE,
                                         MIN_HEADER_SIZE),
        http2_max_streams=whole(env_names.HTTP2_MAX_STREAMS, DEFAULT_HTTP2_MAX_STREAMS, 1),
        http2_max_resets=whole(env_names.HTTP2_MAX_RESETS, DEFAULT_HTTP2_MAX_RESETS),
        idle_timeout=_number(env, env_names.IDLE_TIMEOUT, DEFAULT_IDLE_TIMEOUT, integer=False))


def parse_udp_port(env: Mapping[str, str]) -> int | None:
    """``TAILNET_UDP_PORT``: a port 0-65535, or ``off`` (None: DERP only)."""
    text = env.get(env_names.UDP_PORT, "").strip()
    if not text:
        return DEFAULT_UDP_PORT
    if text.lower() == "off":
        return None
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise ConfigError(f"{env_names.UDP_PORT} must be a port 0-65535 or 'off', got {text!r}")
    return int(text)
