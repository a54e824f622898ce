"""The sans-IO frame codec: framing, limits, NaCl sealing, message parsing."""

from __future__ import annotations

import json
import os
import struct

import nacl.public
import pytest

from hack import derp_codec as codec
from tailnet_agent.derp import frames as f
from tailnet_agent.derp.errors import BadServerKey, CryptoError, FrameTooLarge, MalformedFrame, PacketTooLarge

KEY_A = bytes(range(32))


def test_magic_matches_the_go_constant() -> None:
    assert f.MAGIC.hex() == "44455250f09f9491"


def test_frame_header_is_type_then_big_endian_length() -> None:
    assert f.encode_frame(0x12, b"abcdefgh") == b"\x12\x00\x00\x00\x08abcdefgh"
    assert f.encode_note_preferred(True) == b"\x07\x00\x00\x00\x01\x01"
    assert f.encode_note_preferred(False) == b"\x07\x00\x00\x00\x01\x00"
    assert codec.encode_send_packet(KEY_A, b"hi") == b"\x04\x00\x00\x00\x22" + KEY_A + b"hi"


def test_decoder_reassembles_frames_split_across_chunks() -> None:
    stream = codec.encode_send_packet(KEY_A, b"x" * 1500) + codec.encode_keep_alive() + f.encode_ping(b"12345678")
    decoder = f.FrameDecoder()
    got: list[f.Frame] = []
    for i in range(len(stream)):  # one byte at a time: every split point, headers included
        got += decoder.feed(stream[i:i + 1])
    assert [fr.type for fr in got] == [f.FrameType.SEND_PACKET, f.FrameType.KEEP_ALIVE, f.FrameType.PING]
    assert got[0].payload == KEY_A + b"x" * 1500
    assert got[2].payload == b"12345678"
    assert decoder.pending() == b""


def test_decoder_returns_several_frames_from_one_chunk_and_keeps_the_partial_tail() -> None:
    stream = codec.encode_keep_alive() + f.encode_ping(b"abcdefgh")
    tail = codec.encode_pong(b"ABCDEFGH")
    decoder = f.FrameDecoder()
    frames = decoder.feed(stream + tail[:7])
    assert [fr.type for fr in frames] == [f.FrameType.KEEP_ALIVE, f.FrameType.PING]
    assert decoder.pending() == tail[:7]
    assert decoder.feed(tail[7:]) == [f.Frame(f.FrameType.PONG, b"ABCDEFGH")]


def test_oversized_frame_is_rejected_from_its_header_alone() -> None:
    decoder = f.FrameDecoder()
    header = struct.pack(">BI", f.FrameType.RECV_PACKET, f.MAX_FRAME_LEN + 1)
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(header)  # no payload bytes needed to reject it
    assert info.value.length == f.MAX_FRAME_LEN + 1 and info.value.limit == 1 << 20
    with pytest.raises(FrameTooLarge):  # the stream cannot be resynchronised
        decoder.feed(codec.encode_keep_alive())


def test_frame_at_the_limit_is_accepted() -> None:
    decoder = f.FrameDecoder(max_frame_len=100)
    assert decoder.feed(f.encode_frame(0x05, bytes(100))) == [f.Frame(0x05, bytes(100))]
    with pytest.raises(FrameTooLarge):
        decoder.feed(struct.pack(">BI", 0x05, 101))


def test_send_packet_enforces_the_64k_max_packet_size() -> None:
    assert f.MAX_PACKET_SIZE == 65536
    frame = codec.encode_send_packet(KEY_A, bytes(f.MAX_PACKET_SIZE))
    assert len(frame) == 5 + 32 + 65536
    with pytest.raises(PacketTooLarge):
        codec.encode_send_packet(KEY_A, bytes(f.MAX_PACKET_SIZE + 1))
    with pytest.raises(ValueError):
        codec.encode_send_packet(KEY_A[:31], b"")


def test_server_key_greeting_is_checked() -> None:
    server_pub = os.urandom(32)
    frame = f.FrameDecoder().feed(codec.encode_server_key(server_pub))[0]
    assert f.parse_server_key(frame) == server_pub
    # extra trailing bytes are allowed "for future-proofing"
    assert f.parse_server_key(f.Frame(f.FrameType.SERVER_KEY, f.MAGIC + server_pub + b"future")) == server_pub
    with pytest.raises(BadServerKey):
        f.parse_server_key(f.Frame(f.FrameType.SERVER_KEY, b"DERP\xf0\x9f\x94\x92" + server_pub))
    with pytest.raises(BadServerKey):
        f.parse_server_key(f.Frame(f.FrameType.SERVER_KEY, f.MAGIC + server_pub[:31]))
    with pytest.raises(BadServerKey):
        f.parse_server_key(f.Frame(f.FrameType.SERVER_INFO, f.MAGIC + server_pub))


def test_client_info_is_sealed_to_the_server_key() -> None:
    server = nacl.public.PrivateKey.generate()
    client_priv = os.urandom(32)
    raw = f.encode_client_info(client_priv, bytes(server.public_key))
    frame = f.FrameDecoder().feed(raw)[0]
    assert frame.type == f.FrameType.CLIENT_INFO
    client_pub = f.public_key_of(client_priv)
    json_doc = b'{"version":2,"CanAckPings":true}'
    # layout: client public key | 24-byte nonce | 16-byte Poly1305 tag | ciphertext
    assert frame.payload[:32] == client_pub
    assert len(frame.payload) == 32 + 24 + 16 + len(json_doc)
    # opened independently of our helpers, with PyNaCl's Box from the server side
    opened = nacl.public.Box(server, nacl.public.PublicKey(client_pub)).decrypt(frame.payload[32:])
    assert json.loads(opened) == {"version": 2, "CanAckPings": True}
    assert opened == json_doc
    assert codec.parse_client_info(bytes(server), frame) == (client_pub, f.ClientInfo())


def test_a_box_does_not_open_with_the_wrong_key() -> None:
    server_priv, client_priv = os.urandom(32), os.urandom(32)
    frame = f.FrameDecoder().feed(f.encode_client_info(client_priv, f.public_key_of(server_priv)))[0]
    with pytest.raises(CryptoError):
        codec.parse_client_info(os.urandom(32), frame)
    tampered = f.Frame(frame.type, frame.payload[:-1] + bytes([frame.payload[-1] ^ 1]))
    with pytest.raises(CryptoError):
        codec.parse_client_info(server_priv, tampered)


def test_server_info_round_trip() -> None:
    server_priv, client_priv = os.urandom(32), os.urandom(32)
    info = f.ServerInfo(version=2, token_bucket_bytes_per_second=1000, token_bucket_bytes_burst=2000)
    raw = codec.encode_server_info(server_priv, f.public_key_of(client_priv), info)
    frame = f.FrameDecoder().feed(raw)[0]
    assert f.parse_server_info(client_priv, f.public_key_of(server_priv), frame) == info
    with pytest.raises(MalformedFrame):
        f.parse_server_info(client_priv, f.public_key_of(server_priv), f.Frame(f.FrameType.SERVER_INFO, b"short"))


@pytest.mark.parametrize(("frame", "message"), [
    (f.Frame(0x05, KEY_A + b"payload"), codec.RecvPacket(KEY_A, b"payload")),
    (f.Frame(0x06, b""), codec.KeepAlive()),
    (f.Frame(0x12, b"12345678"), codec.Ping(b"12345678")),
    (f.Frame(0x13, b"12345678extra"), codec.Pong(b"12345678")),
    (f.Frame(0x08, KEY_A), codec.PeerGone(KEY_A, codec.PeerGoneReason.DISCONNECTED)),
    (f.Frame(0x08, KEY_A + b"\x01"), codec.PeerGone(KEY_A, codec.PeerGoneReason.NOT_HERE)),
    (f.Frame(0x14, b"duplicate connection"), codec.Health("duplicate connection")),
    (f.Frame(0x14, b""), codec.Health("")),
    (f.Frame(0x15, struct.pack(">II", 1500, 10000)), codec.Restarting(1.5, 10.0)),
    (f.Frame(0x09, KEY_A), codec.UnknownFrame(0x09, KEY_A)),
    (f.Frame(0x7F, b"new"), codec.UnknownFrame(0x7F, b"new")),
])
def test_parse_message(frame: f.Frame, message: codec.Message) -> None:
    assert codec.parse_message(frame) == message


@pytest.mark.parametrize("frame", [
    f.Frame(0x05, KEY_A[:31]), f.Frame(0x12, b"1234567"), f.Frame(0x08, b""), f.Frame(0x15, b"\x00" * 7),
])
def test_short_frames_are_malformed(frame: f.Frame) -> None:
    with pytest.raises(MalformedFrame):
        codec.parse_message(frame)


def test_ping_data_must_be_8_bytes() -> None:
    with pytest.raises(ValueError):
        f.encode_ping(b"short")
    assert codec.encode_pong(b"abcdefgh") == b"\x13\x00\x00\x00\x08abcdefgh"
