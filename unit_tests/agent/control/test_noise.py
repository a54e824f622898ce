"""Noise IK initiator and record codec: Go known-answer vectors, layout, tampering, limits."""

from __future__ import annotations

import hashlib
import struct

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from tailnet_agent.control.errors import HandshakeRefused, NoiseError, ProtocolViolation
from tailnet_agent.control.keys import MACHINE_PUBLIC_PREFIX, PrivateKey, _clamp
from tailnet_agent.control.noise import (
    MAX_MESSAGE_SIZE,
    MAX_PLAINTEXT_SIZE,
    ClientHandshake,
    NoiseTransport,
    transport_nonce,
)

from .responder import respond

# Produced once with a throwaway Go program (not in the repo) built against tailscale.com v1.98.10:
# it ran controlbase.Server(ctx, conn, controlKey, init) on a TCP socket with the control private
# key below, received INIT from this Python initiator (fixed machine and ephemeral keys), answered
# RESPONSE, read and decrypted the client's records ("client-0", "client-1", 5000 x "x") with
# controlbase's Conn.Read, and wrote "server-0", "server-1", "server-2" with Conn.Write (SERVER_RECORDS).
MACHINE = PrivateKey(_clamp(bytes([0x11] * 32)), MACHINE_PUBLIC_PREFIX)
EPHEMERAL = PrivateKey(_clamp(bytes([0x22] * 32)), MACHINE_PUBLIC_PREFIX)
CONTROL = PrivateKey(_clamp(bytes([0x33] * 32)), MACHINE_PUBLIC_PREFIX)
CONTROL_PUB = bytes.fromhex("7b0d47d93427f8311160781c7c733fd89f88970aef490d8aa0ee19a4cb8a1b14")
VERSION = 138
INIT = bytes.fromhex(
    "008a0100600faa684ed28867b97f4a6a2dee5df8ce974e76b7018e3f22a1c4cf2678570f2061d2949213e755bc180b5d5dbbd8c50a2a1b"
    "eb69f8940d24cab4606a34cd5d41c95b4df28b167f81da3e32e06da4539bec5a66aaaeffd3e95083c378dd2d7f90")
RESPONSE = bytes.fromhex(
    "0200306a3e5e8a09ad8b4e01b9e498a057e7eef8214b7aa7284f7b1a1fc9bfc0e9ec3d0cd575ad032a9fa28abac7b5395b20a9")
SERVER_RECORDS = bytes.fromhex(
    "040018e5dc380a34cbb527ab6c0927f302fdb8ce167bf9c13c0fa2040018686fea0b1cc9f448bbd092c8ac09529a3193b129a26d0704"
    "04001839595f57fb79214c63022f44ec26687441c162d4273a9f7b")
HANDSHAKE_HASH = bytes.fromhex("002134999e11447331d4703e451356b7ba4af1cd28a4e5a8dd25e2fcb0007c52")
CLIENT_FIRST_TWO_RECORDS = bytes.fromhex(
    "0400184a49ec97a373672fd54c8f2b6c8b064b498db137b7fb516f04001807703dea2c2f9a44dac650daae69f6b8b49942d955d489f9")
CLIENT_RECORDS_SHA256 = "600f017d860aabc028cf09d185a03ca87b71aff26629b99e764b0979c4c1ae74"


def go_session() -> NoiseTransport:
    hs = ClientHandshake(MACHINE, CONTROL_PUB, VERSION, ephemeral=EPHEMERAL)
    result = hs.receive_data(RESPONSE)
    assert result is not None
    transport, leftover = result
    assert leftover == b""
    return transport


def test_control_public_key_matches_go() -> None:
    assert CONTROL.public.raw == CONTROL_PUB


def test_initiation_matches_the_one_go_accepted() -> None:
    hs = ClientHandshake(MACHINE, CONTROL_PUB, VERSION, ephemeral=EPHEMERAL)
    assert hs.initiation == INIT
    version, msg_type, length = struct.unpack_from(">HBH", INIT)
    assert (version, msg_type, length, len(INIT)) == (138, 1, 96, 101)
    assert INIT[5:37] == EPHEMERAL.public.raw


def test_go_response_completes_the_handshake_with_the_same_hash() -> None:
    assert go_session().handshake_hash == HANDSHAKE_HASH


def test_go_server_records_decrypt() -> None:
    transport = go_session()
    assert transport.receive_data(SERVER_RECORDS) == b"server-0server-1server-2"
    assert transport.rx.counter == 3


def test_client_records_are_the_ones_go_decrypted() -> None:
    transport = go_session()
    records = transport.encrypt(b"client-0") + transport.encrypt(b"client-1") + transport.encrypt(b"x" * 5000)
    assert records[:len(CLIENT_FIRST_TWO_RECORDS)] == CLIENT_FIRST_TWO_RECORDS
    assert hashlib.sha256(records).hexdigest() == CLIENT_RECORDS_SHA256
    assert transport.tx.counter == 4  # 5000 bytes took two records


def test_nonce_is_four_zero_bytes_then_big_endian_counter() -> None:
    assert transport_nonce(1) == bytes(11) + b"\x01"
    assert transport_nonce(0x0102) == bytes(10) + b"\x01\x02"
    key = bytes(range(32))
    transport = NoiseTransport(tx_key=key, rx_key=key, handshake_hash=b"")
    transport.encrypt(b"first")
    record = transport.encrypt(b"second")
    assert record[:3] == b"\x04\x00\x16"
    aead = ChaCha20Poly1305(key)
    assert aead.decrypt(bytes(4) + (1).to_bytes(8, "big"), record[3:], None) == b"second"
    with pytest.raises(InvalidTag):  # the Noise spec's little-endian counter would not open it
        aead.decrypt(bytes(4) + (1).to_bytes(8, "little"), record[3:], None)


def test_tampered_record_is_rejected_and_breaks_the_stream() -> None:
    transport = go_session()
    tampered = bytearray(SERVER_RECORDS)
    tampered[10] ^= 0x01
    with pytest.raises(NoiseError):
        transport.receive_data(bytes(tampered[:27]))
    with pytest.raises(NoiseError):
        transport.receive_data(SERVER_RECORDS[27:54])


def test_tampered_response_fails_the_handshake() -> None:
    hs = ClientHandshake(MACHINE, CONTROL_PUB, VERSION, ephemeral=EPHEMERAL)
    bad = bytearray(RESPONSE)
    bad[-1] ^= 0x80
    with pytest.raises(NoiseError):
        hs.receive_data(bytes(bad))


def test_response_may_arrive_in_pieces_with_records_behind_it() -> None:
    hs = ClientHandshake(MACHINE, CONTROL_PUB, VERSION, ephemeral=EPHEMERAL)
    wire = RESPONSE + SERVER_RECORDS[:30]
    assert hs.receive_data(wire[:2]) is None
    assert hs.receive_data(wire[2:40]) is None
    result = hs.receive_data(wire[40:])
    assert result is not None
    transport, leftover = result
    assert leftover == SERVER_RECORDS[:30]
    assert transport.receive_data(leftover) == b"server-0"
    assert transport.receive_data(SERVER_RECORDS[30:]) == b"server-1server-2"


def test_server_error_message_is_reported() -> None:
    hs = ClientHandshake(MACHINE, CONTROL_PUB, VERSION)
    msg = b"wrong handshake initiation size"
    assert hs.receive_data(struct.pack(">BH", 3, len(msg)) + msg[:5]) is None
    with pytest.raises(HandshakeRefused, match="wrong handshake"):
        hs.receive_data(msg[5:])


def test_unexpected_message_type_is_a_violation() -> None:
    with pytest.raises(ProtocolViolation):
        ClientHandshake(MACHINE, CONTROL_PUB, VERSION).receive_data(b"\x04\x00\x30" + bytes(48))
    with pytest.raises(ProtocolViolation):
        ClientHandshake(MACHINE, CONTROL_PUB, VERSION).receive_data(b"\x02\x00\x31" + bytes(49))


def test_roundtrip_with_python_responder_and_splitting() -> None:
    hs = ClientHandshake(MACHINE, CONTROL.public.raw, 130)
    response, server, machine = respond(CONTROL, hs.initiation)
    assert machine == MACHINE.public.raw
    result = hs.receive_data(response)
    assert result is not None
    client, _ = result
    assert client.handshake_hash == server.handshake_hash
    big = bytes(range(256)) * 40  # 10240 bytes: three records
    wire = client.encrypt(big)
    assert len(wire) == 3 * 3 + len(big) + 3 * 16
    assert struct.unpack_from(">H", wire, 1)[0] + 3 == MAX_MESSAGE_SIZE  # the first record is full
    received = b"".join(server.receive_data(wire[i:i + 1000]) for i in range(0, len(wire), 1000))
    assert received == big
    assert client.receive_data(server.encrypt(b"pong")) == b"pong"
    assert MAX_PLAINTEXT_SIZE == 4077


def test_oversized_record_header_is_rejected() -> None:
    transport = go_session()
    with pytest.raises(ProtocolViolation):
        transport.receive_data(struct.pack(">BH", 4, MAX_MESSAGE_SIZE - 2))
    with pytest.raises(ProtocolViolation):
        go_session().receive_data(struct.pack(">BH", 2, 16))


def test_version_must_fit_u16() -> None:
    with pytest.raises(ValueError):
        ClientHandshake(MACHINE, CONTROL_PUB, 70000)
