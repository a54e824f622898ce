"""STUN binding requests (RFC 5389), as tailscale's ``net/stun`` sends them to DERP nodes.

The answer's XOR-MAPPED-ADDRESS is the address this node's UDP socket has as seen from the DERP
node; reported as a STUN endpoint, it lets peers outside the node's own network try a direct
path (through a NAT that keeps the mapping per socket). Tailscale's STUN server only answers
requests that carry the SOFTWARE attribute ``tailnode`` and end with a FINGERPRINT.
"""

from __future__ import annotations

import ipaddress
import os
import struct
import zlib

MAGIC_COOKIE = 0x2112A442
BINDING_REQUEST = 0x0001
BINDING_SUCCESS = 0x0101
ATTR_MAPPED_ADDRESS = 0x0001
ATTR_XOR_MAPPED_ADDRESS = 0x0020
ATTR_SOFTWARE = 0x8022
ATTR_FINGERPRINT = 0x8028
SOFTWARE = b"tailnode"
HEADER_LEN = 20
TX_ID_LEN = 12
DEFAULT_PORT = 3478
"""A DERP node's STUN port when its ``STUNPort`` is 0."""


def new_tx_id() -> bytes:
    return os.urandom(TX_ID_LEN)


def _fingerprint(data: bytes) -> int:
    return zlib.crc32(data) ^ 0x5354554E


def binding_request(tx_id: bytes) -> bytes:
    """A binding request with SOFTWARE and FINGERPRINT, as ``stun.Request``."""
    attrs_len = 4 + len(SOFTWARE) + 8
    head = struct.pack("!HHI", BINDING_REQUEST, attrs_len, MAGIC_COOKIE) + tx_id
    body = struct.pack("!HH", ATTR_SOFTWARE, len(SOFTWARE)) + SOFTWARE
    return head + body + struct.pack("!HHI", ATTR_FINGERPRINT, 4, _fingerprint(head + body))


def looks_like_stun(packet: bytes) -> bool:
    return len(packet) >= HEADER_LEN and packet[0] & 0xC0 == 0 and packet[4:8] == struct.pack("!I", MAGIC_COOKIE)


def parse_response(packet: bytes) -> tuple[bytes, tuple[str, int]] | None:
    """(transaction id, mapped address) of a binding success response; None otherwise."""
    if not looks_like_stun(packet):
        return None
    kind, length = struct.unpack("!HH", packet[:4])
    if kind != BINDING_SUCCESS or len(packet) < HEADER_LEN + length:
        return None
    tx_id = packet[8:HEADER_LEN]
    attrs = packet[HEADER_LEN:HEADER_LEN + length]
    mapped: tuple[str, int] | None = None
    while len(attrs) >= 4:
        attr, size = struct.unpack("!HH", attrs[:4])
        value = attrs[4:4 + size]
        if attr == ATTR_XOR_MAPPED_ADDRESS:
            return tx_id, _address(value, xor=packet[4:HEADER_LEN])
        if attr == ATTR_MAPPED_ADDRESS and mapped is None:
            mapped = _address(value, xor=b"")
        attrs = attrs[4 + size + (-size % 4):]
    return None if mapped is None else (tx_id, mapped)


def _address(value: bytes, *, xor: bytes) -> tuple[str, int]:
    """An (X)OR-MAPPED-ADDRESS value; ``xor`` is cookie + transaction id (empty: not XORed)."""
    family, port = value[1], struct.unpack("!H", value[2:4])[0]
    raw = value[4:8] if family == 1 else value[4:20]
    if xor:
        port ^= MAGIC_COOKIE >> 16
        raw = bytes(a ^ b for a, b in zip(raw, xor, strict=False))
    return str(ipaddress.ip_address(raw)), port
