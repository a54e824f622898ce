"""Sans-IO HTTP/1.1 upgrade to ``/ts2021`` (``control/controlhttp/client.go tryURLUpgrade``).

The client POSTs ``/ts2021`` with ``Upgrade: tailscale-control-protocol``, ``Connection: upgrade``
and ``X-Tailscale-Handshake: <std base64 of the Noise initiation>``; the server answers ``101``
with the same ``Upgrade`` value and then corks its Noise response (and the first records) right
behind the HTTP head, so whatever follows the head must be kept.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ProtocolViolation
from .keys import PublicKey, machine_public

UPGRADE_PATH = "/ts2021"
UPGRADE_PROTOCOL = "tailscale-control-protocol"
HANDSHAKE_HEADER = "X-Tailscale-Handshake"
MAX_HEAD_SIZE = 64 * 1024


def upgrade_request(authority: str, initiation: bytes) -> bytes:
    """The HTTP/1.1 request that carries the handshake initiation."""
    lines = [
        f"POST {UPGRADE_PATH} HTTP/1.1",
        f"Host: {authority}",
        f"Upgrade: {UPGRADE_PROTOCOL}",
        "Connection: upgrade",
        f"{HANDSHAKE_HEADER}: {base64.b64encode(initiation).decode()}",
        "Content-Length: 0",
        "User-Agent: tailnet-agent",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass(frozen=True, kw_only=True)
class UpgradeResponse:
    status: int
    reason: str
    headers: dict[str, str] = field(default_factory=dict)
    """Lower-case names; repeated headers are joined with ``, ``."""
    leftover: bytes = b""
    """Bytes after the head: the start of the Noise response."""


def parse_upgrade_response(buffer: bytes) -> UpgradeResponse | None:
    """Parse the response head once ``\\r\\n\\r\\n`` has arrived; None means read more."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_SIZE:
            raise ProtocolViolation("HTTP response head is too large")
        return None
    head = buffer[:end].decode("latin-1").split("\r\n")
    parts = head[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not (parts[1].isascii() and parts[1].isdigit()):
        raise ProtocolViolation(f"not an HTTP/1.x status line: {head[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in head[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolViolation(f"malformed header line: {line[:80]!r}")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return UpgradeResponse(status=int(parts[1]), reason=parts[2] if len(parts) > 2 else "", headers=headers,
                           leftover=buffer[end + 4:])


def check_upgrade(response: UpgradeResponse) -> None:
    """Raise unless the server switched to the control protocol."""
    if response.status != 101:
        raise ProtocolViolation(f"/ts2021 upgrade answered {response.status} {response.reason}")
    if response.headers.get("upgrade", "").lower() != UPGRADE_PROTOCOL:
        raise ProtocolViolation(f"server switched to unexpected protocol {response.headers.get('upgrade')!r}")


def parse_server_key(body: bytes) -> PublicKey:
    """The Noise key from ``GET /key?v=<capver>`` (``tailcfg.OverTLSPublicKeyResponse``)."""
    try:
        doc: Any = json.loads(body)
        return machine_public(str(doc["publicKey"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolViolation("/key did not return a publicKey (server too old, or not a control server?)") \
            from exc
