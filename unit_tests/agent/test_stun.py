"""STUN requests as tailscale's server wants them; responses with XOR-MAPPED-ADDRESS."""

from __future__ import annotations

import struct
import zlib

from tailnet_agent.stun import MAGIC_COOKIE, binding_request, looks_like_stun, parse_response


def test_request_carries_software_and_a_valid_fingerprint() -> None:
    tx = bytes(range(12))
    req = binding_request(tx)
    assert req[:2] == b"\x00\x01" and req[4:8] == struct.pack("!I", MAGIC_COOKIE) and req[8:20] == tx
    assert struct.unpack("!H", req[2:4])[0] == len(req) - 20
    assert req[20:32] == b"\x80\x22\x00\x08tailnode"
    assert req[32:36] == b"\x80\x28\x00\x04"
    assert struct.unpack("!I", req[36:])[0] == zlib.crc32(req[:32]) ^ 0x5354554E
    assert looks_like_stun(req)


def response(tx: bytes, ip: bytes, port: int, *, family: int = 1) -> bytes:
    xor = struct.pack("!I", MAGIC_COOKIE) + tx
    xport = port ^ (MAGIC_COOKIE >> 16)
    xip = bytes(a ^ b for a, b in zip(ip, xor, strict=False))
    attr = struct.pack("!HHBBH", 0x0020, 4 + len(ip), 0, family, xport) + xip
    return struct.pack("!HHI", 0x0101, len(attr), MAGIC_COOKIE) + tx + attr


def test_xor_mapped_addresses_v4_and_v6() -> None:
    tx = b"T" * 12
    assert parse_response(response(tx, bytes([203, 0, 113, 7]), 41641)) == (tx, ("203.0.113.7", 41641))
    v6 = bytes.fromhex("20010db8000000000000000000000001")
    assert parse_response(response(tx, v6, 5, family=2)) == (tx, ("2001:db8::1", 5))


def test_other_packets_are_not_responses() -> None:
    assert parse_response(binding_request(b"x" * 12)) is None
    assert parse_response(b"\x04\x00\x00\x00" + b"\x00" * 28) is None
    assert not looks_like_stun(b"TS\xf0\x9f\x92\xac" + b"\x00" * 40)
