"""The sans-IO handshake against a scripted server built from the server-side helpers."""

from __future__ import annotations

import os

import pytest

from hack import derp_codec as codec
from tailnet_agent.derp import frames as f
from tailnet_agent.derp.errors import BadServerKey, FrameTooLarge, ProtocolError, UpgradeRefused
from tailnet_agent.derp.handshake import ClientHandshake, HandshakeState, upgrade_request

RESPONSE_101 = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n"
                b"Derp-Version: 2\r\nDerp-Public-Key: nodekey:00\r\n\r\n")


def test_upgrade_request() -> None:
    req = upgrade_request("derp.example.com")
    assert req.startswith(b"GET /derp HTTP/1.1\r\nHost: derp.example.com\r\n")
    assert b"\r\nUpgrade: DERP\r\n" in req and b"\r\nConnection: Upgrade\r\n" in req
    assert req.endswith(b"\r\n\r\n")
    assert b"Host: [fd00::1]\r\n" in upgrade_request("fd00::1")


def state(hs: ClientHandshake) -> HandshakeState:
    """Read the state through a call, so the type checker does not narrow it across receive_data."""
    return hs.state


def _server_reply(server_priv: bytes, hs: ClientHandshake) -> bytes:
    return codec.encode_server_info(server_priv, hs.public_key, f.ServerInfo(version=2))


@pytest.mark.parametrize("chunk_size", [1, 7, 10_000])
def test_full_handshake_in_any_chunking(chunk_size: int) -> None:
    server_priv = os.urandom(32)
    client_priv = os.urandom(32)
    hs = ClientHandshake(client_priv, host="127.0.0.1")
    assert hs.data_to_send() == upgrade_request("127.0.0.1")
    assert hs.data_to_send() == b""

    first = RESPONSE_101 + codec.encode_server_key(f.public_key_of(server_priv))
    for i in range(0, len(first), chunk_size):
        hs.receive_data(first[i:i + chunk_size])
    assert state(hs) is HandshakeState.AWAITING_SERVER_INFO
    assert hs.response_headers["derp-version"] == "2"
    assert hs.server_key == f.public_key_of(server_priv)

    client_info = f.FrameDecoder().feed(hs.data_to_send())
    assert len(client_info) == 1
    assert codec.parse_client_info(server_priv, client_info[0]) == (f.public_key_of(client_priv), f.ClientInfo())

    trailing = codec.encode_keep_alive() + f.encode_ping(b"12345678")[:3]
    second = _server_reply(server_priv, hs) + trailing
    for i in range(0, len(second), chunk_size):
        hs.receive_data(second[i:i + chunk_size])
        if state(hs) is HandshakeState.ESTABLISHED:
            rest = second[i + chunk_size:]
            break
    assert state(hs) is HandshakeState.ESTABLISHED
    assert hs.server_info == f.ServerInfo(version=2)
    assert hs.trailing_data() + rest == trailing


def test_everything_in_one_chunk_leaves_the_trailing_frames() -> None:
    server_priv, client_priv = os.urandom(32), os.urandom(32)
    hs = ClientHandshake(client_priv, host="h")
    hs.receive_data(RESPONSE_101 + codec.encode_server_key(f.public_key_of(server_priv)))
    after = codec.encode_recv_packet(os.urandom(32), b"data")
    hs.receive_data(_server_reply(server_priv, hs) + after)
    assert hs.state is HandshakeState.ESTABLISHED
    assert hs.trailing_data() == after
    with pytest.raises(ProtocolError):
        hs.receive_data(b"more")


def test_non_101_is_refused_with_the_status() -> None:
    hs = ClientHandshake(os.urandom(32), host="h")
    with pytest.raises(UpgradeRefused) as info:
        hs.receive_data(b"HTTP/1.1 426 Upgrade Required\r\nContent-Type: text/plain\r\n\r\n"
                        b"DERP requires connection upgrade")
    assert info.value.status == 426
    assert b"DERP requires connection upgrade" in info.value.body


def test_bad_magic_is_rejected() -> None:
    hs = ClientHandshake(os.urandom(32), host="h")
    with pytest.raises(BadServerKey):
        hs.receive_data(RESPONSE_101 + f.encode_frame(f.FrameType.SERVER_KEY, b"NOTMAGIC" + bytes(32)))


def test_oversized_server_key_frame_is_rejected() -> None:
    hs = ClientHandshake(os.urandom(32), host="h")
    with pytest.raises(FrameTooLarge):
        hs.receive_data(RESPONSE_101 + b"\x01\x00\x00\x04\x01")  # 1025 > 1 KiB


def test_frame_other_than_server_info_after_client_info() -> None:
    server_priv = os.urandom(32)
    hs = ClientHandshake(os.urandom(32), host="h")
    hs.receive_data(RESPONSE_101 + codec.encode_server_key(f.public_key_of(server_priv)))
    with pytest.raises(ProtocolError):
        hs.receive_data(codec.encode_keep_alive())


def test_upgrade_to_something_else_is_a_protocol_error() -> None:
    hs = ClientHandshake(os.urandom(32), host="h")
    with pytest.raises(ProtocolError):
        hs.receive_data(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n")
