"""DerpConnection against the in-process fake server (plain TCP, no TLS)."""

from __future__ import annotations

import os

import pytest

from hack import derp_codec as codec
from tailnet_agent.derp import frames as f
from tailnet_agent.derp.connection import DerpConnection, DerpNode, addresses_by_family, dial_addresses
from tailnet_agent.derp.errors import ConnectionLost, HandshakeRejected, UpgradeRefused

from .fakeserver import FakeDerpServer


def node(server: FakeDerpServer) -> DerpNode:
    return DerpNode(host_name="derp.test", ipv4="127.0.0.1", ipv6="none", derp_port=server.port)


def test_dial_addresses_follow_the_derp_node_fields() -> None:
    assert dial_addresses(DerpNode(host_name="h", ipv4="10.0.0.1")) == ["10.0.0.1", "h"]
    assert dial_addresses(DerpNode(host_name="h", ipv4="10.0.0.1", ipv6="none")) == ["10.0.0.1"]
    assert dial_addresses(DerpNode(host_name="h", ipv4="none", ipv6="fd00::1")) == ["fd00::1"]
    assert dial_addresses(DerpNode(host_name="h")) == ["h"]
    assert dial_addresses(DerpNode(host_name="h", ipv4="fd00::1", ipv6="none")) == []


def test_addresses_by_family_name_each_family_the_node_may_be_reached_over() -> None:
    assert addresses_by_family(DerpNode(host_name="h")) == [(4, "h"), (6, "h")]
    assert addresses_by_family(DerpNode(host_name="h", ipv4="127.0.0.1", ipv6="none")) == [(4, "127.0.0.1")]
    assert addresses_by_family(DerpNode(host_name="h", ipv4="none", ipv6="::1")) == [(6, "::1")]


async def test_handshake_then_packets_pings_and_note_preferred() -> None:
    peer = os.urandom(32)
    async with FakeDerpServer(after_server_info=codec.encode_keep_alive()) as server:
        key = os.urandom(32)
        async with await DerpConnection.open(node(server), key, plaintext=True, read_timeout=5) as conn:
            assert conn.server_key == server.public_key
            assert conn.server_info.version == 2
            assert server.client_infos == [(f.public_key_of(key), f.ClientInfo())]
            assert b"Host: derp.test\r\n" in server.requests[0]

            assert isinstance(await codec.recv_message(conn), codec.KeepAlive)  # bytes that followed ServerInfo
            await conn.note_preferred(True)
            await codec.send_packet(conn, peer, b"hello")
            await server.send(f.encode_ping(b"pingdata") + codec.encode_health("") +
                              codec.encode_recv_packet(peer, b"world"))
            assert await codec.recv_packet(conn) == (peer, b"world")  # Ping answered on the way
            frames = await server.wait_frames(3)
            assert frames[0] == f.Frame(f.FrameType.NOTE_PREFERRED, b"\x01")
            assert frames[1] == f.Frame(f.FrameType.SEND_PACKET, peer + b"hello")
            assert frames[2] == f.Frame(f.FrameType.PONG, b"pingdata")


async def test_raw_mode_hands_over_the_bytes_after_the_handshake() -> None:
    peer = os.urandom(32)
    after = codec.encode_recv_packet(peer, b"early")
    async with FakeDerpServer(after_server_info=after) as server, \
            await DerpConnection.open(node(server), os.urandom(32), plaintext=True, read_timeout=5) as conn:
        got = b""
        while len(got) < len(after):
            got += await conn.read_chunk()
        assert got == after
        conn.write(codec.encode_send_packet(peer, b"x"))
        await conn.drain()
        assert (await server.wait_frames(1))[0].payload == peer + b"x"


async def test_server_close_is_connection_lost() -> None:
    async with FakeDerpServer() as server, \
            await DerpConnection.open(node(server), os.urandom(32), plaintext=True, read_timeout=5) as conn:
        await server.drop_all()
        with pytest.raises(ConnectionLost):
            await conn.read_chunk()


async def test_silence_beyond_the_read_timeout_is_connection_lost() -> None:
    async with FakeDerpServer() as server, \
            await DerpConnection.open(node(server), os.urandom(32), plaintext=True, read_timeout=0.2) as conn:
        with pytest.raises(ConnectionLost, match="no data"):
            await codec.recv_message(conn)


async def test_close_after_client_info_is_a_rejected_key() -> None:
    async with FakeDerpServer(admit=False) as server:
        with pytest.raises(HandshakeRejected, match="not admitted"):
            await DerpConnection.open(node(server), os.urandom(32), plaintext=True)


async def test_non_101_is_upgrade_refused() -> None:
    async with FakeDerpServer(status_line="HTTP/1.1 426 Upgrade Required") as server:
        with pytest.raises(UpgradeRefused) as info:
            await DerpConnection.open(node(server), os.urandom(32), plaintext=True)
        assert info.value.status == 426
