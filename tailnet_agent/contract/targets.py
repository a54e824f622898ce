"""The egress targets file (``TAILNET_TARGETS_FILE``, or inline ``TAILNET_TARGETS``).

The operator writes it into the agent's ConfigMap (:func:`targets_document`); the agent parses it
at startup and on every change (:func:`parse_targets`). A JSON list of
``{"name": str, "address": str, "ports": [...]}``. ``address`` is a tailnet IP, an IP inside an
accepted subnet route, or a MagicDNS name (``host`` or ``host.<domain>``). Each port is either an
integer (listen on the same port) or ``{"port": 5432, "listen": 15432}``, where ``listen`` is the
local port the operator's Service points at (default: ``port``). Example::

    [{"name": "db", "address": "100.64.0.7", "ports": [5432, {"port": 443, "listen": 8443}]}]
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .environment import TARGETS
from .errors import ConfigError

__all__ = ["PortMapping", "Target", "parse_targets", "targets_document"]


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


def targets_document(targets: Iterable[Target]) -> str:
    """The file as the operator writes it: every port in the long form, stable for equal input."""
    doc = [{"name": t.name, "address": t.address, "ports": [{"port": p.port, "listen": p.listen} for p in t.ports]}
           for t in targets]
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def _port(name: str, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(f"{name}: {where} must be a port number 1-65535, got {value!r}")
    return value


def parse_targets(text: str, *, name: str = TARGETS) -> tuple[Target, ...]:
    """Parse the targets JSON (shape in the module docstring); listen ports must be unique.

    ``name`` is the variable the text came from, for the messages."""
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
