"""The agent's configuration, read once at startup from the environment and mounted files.

Every problem is a :class:`ConfigError` with a one-line message naming the variable. Variables:

=========================  ======================================================================
``TAILNET_CONTROL_URL``    Headscale URL (``https://...``). Required.
``TAILNET_AUTH_KEY_FILE``  File holding the pre-auth key (the operator mounts a Secret). Required.
                           The key is never logged or shown in ``repr``.
``TAILNET_HOSTNAME``       Node hostname on the tailnet. Required.
``TAILNET_CA_BUNDLE``      PEM file of CAs trusted for control and DERP TLS. Unset: system store.
``TAILNET_TARGETS``        Egress targets as JSON (below). Required for egress.
``TAILNET_TARGETS_FILE``   The same JSON read from a file; used when ``TAILNET_TARGETS`` is unset.
                           The file is followed: a change applies without a restart.
``TAILNET_EXPOSES_FILE``   Ingress exposes as JSON (:mod:`tailnet_agent.exposes`). Required for
                           ingress; followed like the targets file.
``TAILNET_BIND_ADDRESS``   Address the egress listeners bind. Default ``0.0.0.0``.
``TAILNET_HEALTH_ADDRESS`` ``host:port`` of /healthz, /readyz and /metrics. Default ``0.0.0.0:9002``.
``TAILNET_ACCEPT_ROUTES``  Use peers' subnet routes (``true``/``false``). Default true for egress.
``TAILNET_DIAL_TIMEOUT``   Seconds a tailnet dial may take. Default 30.
``TAILNET_UDP_PORT``       UDP port for direct paths to peers (disco and WireGuard), ``0`` for any
                           free port, ``off`` for DERP only. Default 41641 (tailscaled's).
=========================  ======================================================================

Targets: a JSON list of ``{"name": str, "address": str, "ports": [...]}``. ``address`` is a tailnet
IP, an IP inside an accepted subnet route, or a MagicDNS name (``host`` or ``host.<domain>``). Each
port is either an integer (listen on the same port) or ``{"port": 5432, "listen": 15432}``, where
``listen`` is the local port the operator's Service points at (default: ``port``). Example::

    [{"name": "db", "address": "100.64.0.7", "ports": [5432, {"port": 443, "listen": 8443}]}]
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

if TYPE_CHECKING:
    from tailnet_agent.exposes import Expose

DEFAULT_HEALTH_ADDRESS = "0.0.0.0:9002"
DEFAULT_BIND_ADDRESS = "0.0.0.0"
DEFAULT_DIAL_TIMEOUT = 30.0
DEFAULT_UDP_PORT = 41641
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is one line meant for the pod's log."""


@dataclass(frozen=True, kw_only=True)
class PortMapping:
    port: int
    """Port dialled on the target."""
    listen: int
    """Local port of the egress listener."""


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    """Label for logs and metrics (the operator uses the target's name in the CR)."""
    address: str
    """Tailnet IP, IP in an accepted route, or MagicDNS name."""
    ports: tuple[PortMapping, ...]


class Forwarded(Protocol):
    """What a forwarder listens for and dials: a :class:`Target`, or an ingress expose
    (:class:`tailnet_agent.exposes.Expose`); each ``PortMapping`` is a listen port and the port dialled."""

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
    health_port: int = 9002
    accept_routes: bool = True
    dial_timeout: float = DEFAULT_DIAL_TIMEOUT
    """Seconds; a dial without a SYN-ACK by then fails as timed out."""
    udp_port: int | None = DEFAULT_UDP_PORT
    """UDP port for direct paths; 0 any; None: DERP only."""


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


def _port(name: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{name}: {where} must be a port number 1-65535, got {value!r}")
    return value


def parse_targets(text: str, *, name: str = "TAILNET_TARGETS") -> tuple[Target, ...]:
    """Parse the targets JSON (shape in the module docstring); listen ports must be unique."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(doc, list):
        raise ConfigError(f"{name} must be a JSON list of targets, got {type(doc).__name__}")
    targets: list[Target] = []
    listens: dict[int, str] = {}
    for i, item in enumerate(doc):
        if not isinstance(item, dict):
            raise ConfigError(f"{name}[{i}] must be an object with name, address and ports")
        label = item.get("name")
        address = item.get("address")
        if not isinstance(label, str) or not label:
            raise ConfigError(f"{name}[{i}].name must be a non-empty string")
        if not isinstance(address, str) or not address.strip():
            raise ConfigError(f"{name}[{i}] ({label}): address must be a non-empty string")
        raw_ports = item.get("ports")
        if not isinstance(raw_ports, list) or not raw_ports:
            raise ConfigError(f"{name}[{i}] ({label}): ports must be a non-empty list")
        ports: list[PortMapping] = []
        for j, entry in enumerate(raw_ports):
            where = f"{label} ports[{j}]"
            if isinstance(entry, dict):
                port = _port(name, entry.get("port"), f"{where}.port")
                listen = _port(name, entry.get("listen", port), f"{where}.listen")
            else:
                port = listen = _port(name, entry, where)
            if listen in listens:
                raise ConfigError(f"{name}: listen port {listen} is used by both {listens[listen]} and {label}")
            listens[listen] = label
            ports.append(PortMapping(port=port, listen=listen))
        targets.append(Target(name=label, address=address.strip(), ports=tuple(ports)))
    return tuple(targets)


def _read_file(name: str, path: str) -> str:
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or exc}") from None


def load(env: Mapping[str, str] | None = None, *, mode: str = "egress") -> AgentConfig:
    """Build the configuration from ``env`` (default ``os.environ``) for ``mode``."""
    env = os.environ if env is None else env
    url = _required(env, "TAILNET_CONTROL_URL")
    parsed = urlparse(url)
    if parsed.scheme not in ("https", "http") or not parsed.netloc:
        raise ConfigError(f"TAILNET_CONTROL_URL must be an http(s) URL, got {url!r}")
    key_file = _required(env, "TAILNET_AUTH_KEY_FILE")
    auth_key = _read_file("TAILNET_AUTH_KEY_FILE", key_file).strip()
    if not auth_key:
        raise ConfigError(f"TAILNET_AUTH_KEY_FILE: {key_file} is empty")
    hostname = _required(env, "TAILNET_HOSTNAME")
    ca_bundle: Path | None = None
    if ca := env.get("TAILNET_CA_BUNDLE", "").strip():
        ca_bundle = Path(ca)
        if not ca_bundle.is_file():
            raise ConfigError(f"TAILNET_CA_BUNDLE: {ca} is not a file")
    targets: tuple[Target, ...] = ()
    targets_file: Path | None = None
    targets_digest = ""
    if mode == "egress":
        if text := env.get("TAILNET_TARGETS", "").strip():
            targets = parse_targets(text)
        elif path := env.get("TAILNET_TARGETS_FILE", "").strip():
            text = _read_file("TAILNET_TARGETS_FILE", path)
            targets = parse_targets(text, name="TAILNET_TARGETS_FILE")
            targets_file, targets_digest = Path(path), hashlib.sha256(text.encode()).hexdigest()
        else:
            raise ConfigError("TAILNET_TARGETS is not set (egress needs at least one target)")
        if not targets:
            raise ConfigError("TAILNET_TARGETS is empty (egress needs at least one target)")
    exposes: tuple[Expose, ...] = ()
    exposes_file: Path | None = None
    if mode == "ingress":
        from tailnet_agent.exposes import parse_exposes

        path = _required(env, "TAILNET_EXPOSES_FILE")
        text = _read_file("TAILNET_EXPOSES_FILE", path)
        exposes = parse_exposes(text)
        exposes_file, targets_digest = Path(path), hashlib.sha256(text.encode()).hexdigest()
    bind = env.get("TAILNET_BIND_ADDRESS", "").strip() or DEFAULT_BIND_ADDRESS
    try:
        ipaddress.ip_address(bind)
    except ValueError:
        raise ConfigError(f"TAILNET_BIND_ADDRESS must be an IP address, got {bind!r}") from None
    health_host, health_port = parse_host_port(
        "TAILNET_HEALTH_ADDRESS", env.get("TAILNET_HEALTH_ADDRESS", "").strip() or DEFAULT_HEALTH_ADDRESS)
    accept = env.get("TAILNET_ACCEPT_ROUTES", "").strip()
    accept_routes = parse_bool("TAILNET_ACCEPT_ROUTES", accept) if accept else mode == "egress"
    timeout_text = env.get("TAILNET_DIAL_TIMEOUT", "").strip()
    dial_timeout = DEFAULT_DIAL_TIMEOUT
    if timeout_text:
        try:
            dial_timeout = float(timeout_text)
        except ValueError:
            raise ConfigError(f"TAILNET_DIAL_TIMEOUT must be seconds, got {timeout_text!r}") from None
        if not dial_timeout > 0:
            raise ConfigError(f"TAILNET_DIAL_TIMEOUT must be positive, got {timeout_text!r}")
    return AgentConfig(control_url=url, auth_key=auth_key, hostname=hostname, ca_bundle=ca_bundle,
                       targets=targets, targets_file=targets_file, targets_digest=targets_digest,
                       exposes=exposes, exposes_file=exposes_file,
                       bind_address=bind, health_host=health_host, health_port=health_port,
                       accept_routes=accept_routes, dial_timeout=dial_timeout, udp_port=parse_udp_port(env))


def parse_udp_port(env: Mapping[str, str]) -> int | None:
    """``TAILNET_UDP_PORT``: a port 0-65535, or ``off`` (None: DERP only)."""
    text = env.get("TAILNET_UDP_PORT", "").strip()
    if not text:
        return DEFAULT_UDP_PORT
    if text.lower() == "off":
        return None
    if not text.isdigit() or not 0 <= int(text) < 65536:
        raise ConfigError(f"TAILNET_UDP_PORT must be a port 0-65535 or 'off', got {text!r}")
    return int(text)
