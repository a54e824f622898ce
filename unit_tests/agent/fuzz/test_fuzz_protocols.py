"""Fuzzing the agent's decoders of bytes from the network: every input is either decoded or
refused with the module's own error type, never another exception.

* TS2021: the HTTP upgrade answer, ``/key``, the Noise handshake response and transport records
  (``ControlError``);
* the ``/machine/map`` stream and the netmap built from it (``ControlError``);
* DERP: the frame decoder, the upgrade answer and the handshake frames, ServerInfo sealed with
  the right keys but carrying any JSON (``DerpError``);
* disco: packets from anyone, sealed or not, to a node with a known peer (ignored or handled);
* the TLS ClientHello a passthrough expose routes by: any bytes, and real hellos with bytes
  changed, cut or split over records (``ClientHelloError``); the answer for a prefix never
  contradicts the answer for the whole.
"""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hack.fuzz import fuzz_settings
from tailnet_agent import disco
from tailnet_agent.control import mapstream, netmap, noise, upgrade
from tailnet_agent.control.client import decode_map_message
from tailnet_agent.control.errors import ControlError
from tailnet_agent.control.keys import MACHINE_PUBLIC_PREFIX, PrivateKey
from tailnet_agent.derp import frames as f
from tailnet_agent.derp import handshake
from tailnet_agent.derp.errors import DerpError
from tailnet_agent.forward.clienthello import READ_LIMIT, ClientHello, ClientHelloError, read_client_hello

from ..control.responder import respond
from ..test_clienthello import openssl_hello, records

_chunks = st.lists(st.binary(max_size=80), max_size=6)
_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=10) | st.sampled_from(["10.0.0.0/8", "100.64.0.1/32", "fd7a::1/128", "nodekey:00", "1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=5,
)
_FIELDS = ["ID", "Key", "DiscoKey", "Addresses", "AllowedIPs", "PrimaryRoutes", "Endpoints", "HomeDERP", "DERP",
           "Online", "Tags", "Capabilities", "CapMap", "Cap", "Hostinfo", "Expired", "KeyExpiry", "Name"]
_PATCH_FIELDS = ["NodeID", "DERPRegion", "Endpoints", "Key", "Online", "Cap", "CapMap"]
_DNS_FIELDS = ["Resolvers", "Domains", "Routes", "ExtraRecords"]
_node = st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=4)
_map_message = st.fixed_dictionaries(
    {},
    optional={
        "Node": _node | _json,
        "Peers": st.lists(_node | _json, max_size=2),
        "PeersChanged": st.lists(_node | _json, max_size=2),
        "PeersRemoved": _json,
        "PeersChangedPatch": st.lists(st.dictionaries(st.sampled_from(_PATCH_FIELDS), _json), max_size=2),
        "OnlineChange": _json,
        "DERPMap": st.fixed_dictionaries({"Regions": st.dictionaries(st.text(max_size=3), _json | st.fixed_dictionaries(
            {"RegionID": _json, "Nodes": st.lists(st.dictionaries(st.sampled_from(
                ["Name", "RegionID", "HostName", "DERPPort", "STUNPort"]), _json), max_size=2)}), max_size=2)}) | _json,
        "DNSConfig": st.dictionaries(st.sampled_from(_DNS_FIELDS), _json) | _json,
        "PacketFilter": st.lists(st.dictionaries(st.sampled_from(["SrcIPs", "DstPorts", "IPProto"]), _json)) | _json,
        "PacketFilters": _json,
        "Domain": _json,
        "KeepAlive": st.booleans(),
    },
)


# -- TS2021 ------------------------------------------------------------------------------------------

_http_heads = st.one_of(
    st.binary(max_size=120),
    st.tuples(st.sampled_from([b"HTTP/1.1 ", b"HTTP/1.0 ", b"HTTP/2 ", b""]), st.binary(max_size=8),
              st.binary(max_size=60)).map(lambda t: t[0] + t[1] + b" x\r\n" + t[2] + b"\r\n\r\n"),
)


@fuzz_settings
@given(_http_heads)
@example(b"HTTP/1.1 \xb2\xb3\xb9 Switching\r\n\r\n")  # latin-1 superscript digits are str.isdigit()
def test_control_upgrade_answer(head: bytes) -> None:
    try:
        response = upgrade.parse_upgrade_response(head)
        if response is not None:
            upgrade.check_upgrade(response)
    except ControlError:
        pass


@fuzz_settings
@given(st.binary(max_size=120) | _json.map(lambda v: json.dumps({"publicKey": v}).encode()))
def test_control_server_key(body: bytes) -> None:
    with contextlib.suppress(ControlError):
        upgrade.parse_server_key(body)


_MACHINE = PrivateKey.generate(MACHINE_PUBLIC_PREFIX)
_CONTROL = PrivateKey.generate(MACHINE_PUBLIC_PREFIX)


@fuzz_settings
@given(st.sampled_from([b"", b"\x02\x00\x30", b"\x03\x00\x05", b"\x04"]), _chunks, st.booleans())
@example(b"\x02\x00\x30", [bytes(48)], False)  # an all-zero (low-order) server ephemeral key
def test_noise_handshake_response(prefix: bytes, chunks: list[bytes], real: bool) -> None:
    hs = noise.ClientHandshake(_MACHINE, _CONTROL.public.raw, 90)
    if real:
        response, _, _ = respond(_CONTROL, hs.initiation)
        prefix = response[:len(response) // 2]
    try:
        for chunk in [prefix, *chunks]:
            if hs.receive_data(chunk) is not None:
                break
    except ControlError:
        pass


@fuzz_settings
@given(st.lists(st.binary(max_size=60), max_size=4), _chunks, st.integers(0, 200), st.integers(0, 255))
def test_noise_records(plaintexts: list[bytes], chunks: list[bytes], at: int, xor: int) -> None:
    hs = noise.ClientHandshake(_MACHINE, _CONTROL.public.raw, 90)
    response, server, _ = respond(_CONTROL, hs.initiation)
    result = hs.receive_data(response)
    assert result is not None
    client, _ = result
    wire = bytearray(b"".join(server.encrypt(p) for p in plaintexts))
    if wire:
        wire[at % len(wire)] ^= xor
    try:
        out = client.receive_data(bytes(wire))
        for chunk in chunks:
            out += client.receive_data(chunk)
    except ControlError:
        return
    if xor == 0 or not wire:
        assert out == b"".join(plaintexts)


# -- the map stream ------------------------------------------------------------------------------------


@fuzz_settings
@given(st.one_of(
    _chunks,
    st.lists(st.binary(max_size=40).map(lambda b: struct.pack("<I", len(b)) + b), max_size=4),
    st.lists(_json.map(lambda v: mapstream.encode_frame({"x": v})), max_size=3),
))
@example([struct.pack("<I", 3000) + b"[" * 3000])  # nesting deeper than the recursion limit
def test_map_stream(chunks: list[bytes]) -> None:
    decoder = mapstream.MapFrameDecoder()
    try:
        for chunk in chunks:
            decoder.feed(chunk)
    except ControlError:
        pass


@fuzz_settings
@given(st.lists(_map_message, min_size=1, max_size=2))
@example([{"Node": {"ID": "x"}}])
@example([{"Node": {"ID": 1, "Addresses": ["not an address"]}}])
@example([{"Node": {"ID": 1}, "PeersRemoved": 5}])
def test_map_messages(messages: list[dict[str, Any]]) -> None:
    current: netmap.NetMap | None = None
    for message in messages:
        try:
            current = decode_map_message(current, message)
        except ControlError:
            return


# -- DERP ------------------------------------------------------------------------------------------------

_NODE_PRIVATE = bytes(PrivateKey.generate("nodekey:").raw)
_SERVER_PRIVATE = bytes(PrivateKey.generate("nodekey:").raw)
_SERVER_PUBLIC = f.public_key_of(_SERVER_PRIVATE)


@fuzz_settings
@given(_chunks, st.integers(1, 1 << 21))
def test_derp_frame_decoder(chunks: list[bytes], limit: int) -> None:
    decoder = f.FrameDecoder(max_frame_len=limit)
    try:
        for chunk in chunks:
            for frame in decoder.feed(chunk):
                assert len(frame.payload) <= limit
    except DerpError:
        pass


def _server_info(payload: Any) -> bytes:
    sealed = f.seal(_SERVER_PRIVATE, f.public_key_of(_NODE_PRIVATE), json.dumps(payload).encode())
    return f.encode_frame(f.FrameType.SERVER_INFO, sealed)


@fuzz_settings
@given(
    _http_heads | st.just(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\n\r\n"),
    st.one_of(
        st.binary(max_size=60),
        st.binary(max_size=40).map(lambda b: f.encode_frame(f.FrameType.SERVER_KEY, f.MAGIC + b)),
    ),
    st.one_of(st.binary(max_size=60), _json.map(_server_info),
              st.dictionaries(st.sampled_from(["version", "TokenBucketBytesPerSecond"]), _json).map(_server_info)),
)
@example(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: DERP\r\n\r\n",
         f.encode_frame(f.FrameType.SERVER_KEY, f.MAGIC + bytes(32)), b"")  # a low-order server key
def test_derp_handshake(head: bytes, server_key: bytes, server_info: bytes) -> None:
    hs = handshake.ClientHandshake(_NODE_PRIVATE, host="derp.test")
    try:
        hs.receive_data(head)
        hs.receive_data(server_key)
        if hs.state is handshake.HandshakeState.AWAITING_SERVER_INFO and hs.server_key == _SERVER_PUBLIC:
            hs.receive_data(server_info)
        hs.receive_data(f.encode_frame(f.FrameType.SERVER_KEY, f.MAGIC + _SERVER_PUBLIC))
        hs.receive_data(_server_info({"version": 2}))
    except DerpError:
        pass


@fuzz_settings
@given(_json)
@example({"version": "two"})
@example({"TokenBucketBytesBurst": [1]})
def test_derp_server_info(doc: Any) -> None:
    frame = f.FrameDecoder().feed(_server_info(doc))[0]
    with contextlib.suppress(DerpError):
        f.parse_server_info(_NODE_PRIVATE, _SERVER_PUBLIC, frame)


# -- disco -------------------------------------------------------------------------------------------------

_OURS = bytes(PrivateKey.generate("discokey:").raw)
_PEER = bytes(PrivateKey.generate("discokey:").raw)
_PEER_NODE = bytes(range(32))


def _disco_node() -> disco.Disco:
    node = disco.Disco(_OURS, f.public_key_of(_OURS), bytes(32))
    node.set_peers([disco.DiscoPeer(node_key=_PEER_NODE, disco_key=f.public_key_of(_PEER), endpoints=(),
                                    derp_region=1)])
    return node


_disco_packets = st.one_of(
    st.binary(max_size=100),
    st.binary(max_size=80).map(lambda b: disco.MAGIC + b),
    st.tuples(st.binary(min_size=32, max_size=32), st.binary(max_size=80)).map(lambda t: disco.MAGIC + t[0] + t[1]),
    # Sealed by the known peer: any plaintext, so every message type and length is reached.
    st.binary(max_size=80).map(
        lambda p: disco.MAGIC + f.public_key_of(_PEER) + f.seal(_PEER, f.public_key_of(_OURS), p)),
    st.tuples(st.sampled_from([1, 2, 3]), st.binary(max_size=60)).map(
        lambda t: disco.MAGIC + f.public_key_of(_PEER)
        + f.seal(_PEER, f.public_key_of(_OURS), bytes([t[0], 0]) + t[1])),
)


@fuzz_settings
@given(st.lists(_disco_packets, min_size=1, max_size=4), st.booleans())
@example([disco.MAGIC + bytes(32) + bytes(40)], False)  # a low-order sender key
def test_disco_packets(packets: list[bytes], over_derp: bool) -> None:
    node = _disco_node()
    for i, packet in enumerate(packets):
        if over_derp:
            node.handle_derp(1, _PEER_NODE, packet, float(i))
        else:
            node.handle_udp(("127.0.0.1", 41641), packet, float(i))
    node.tick(10.0, [_PEER_NODE])


def test_disco_peer_with_a_low_order_key_stays_on_derp() -> None:
    node = disco.Disco(_OURS, f.public_key_of(_OURS), bytes(32))
    node.set_peers([disco.DiscoPeer(node_key=_PEER_NODE, disco_key=bytes(32), endpoints=(("127.0.0.1", 9),),
                                    derp_region=1)])
    assert node.tick(10.0, [_PEER_NODE]) == []


@pytest.mark.parametrize("plaintext", [b"", b"\x01", b"\x02\x00" + bytes(29), b"\x03\x00" + bytes(17)])
def test_disco_decode_short_bodies(plaintext: bytes) -> None:
    assert disco.decode(plaintext) is None


# -- TLS ClientHello ---------------------------------------------------------------------------------

_HELLO = openssl_hello("shop.example.test", alpn=("h2", "http/1.1"))


def _changed(hello: bytes, edits: list[tuple[int, int]], cut: int | None, sizes: list[int]) -> bytes:
    """``hello``'s handshake message with bytes replaced (position, value), cut short, in records of
    these sizes."""
    message = bytearray(hello[5:])
    for at, value in edits:
        message[at % len(message)] = value
    return records(bytes(message[:cut]), sizes)


_client_hellos = st.one_of(
    st.binary(max_size=400),
    st.binary(max_size=200).map(lambda b: b"\x16\x03\x01" + b),
    st.builds(_changed, st.just(_HELLO), st.lists(st.tuples(st.integers(0, 1 << 12), st.integers(0, 255)),
                                                   max_size=3),
              st.none() | st.integers(0, len(_HELLO)), st.lists(st.integers(1, 300), max_size=20)),
)


def _read(data: bytes) -> ClientHello | ClientHelloError | None:
    try:
        return read_client_hello(data)
    except ClientHelloError as exc:
        return exc


@fuzz_settings
@given(_client_hellos, st.integers(0, 1 << 12))
@example(_HELLO, 0)
@example(records(_HELLO[5:], [1] * 17), 30)
def test_client_hello(data: bytes, cut: int) -> None:
    whole = _read(data)
    part = _read(data[:cut])
    if isinstance(whole, ClientHello):
        assert part == (whole if cut >= whole.size else None)
    elif whole is None:
        assert part is None and len(data) < READ_LIMIT
    else:
        assert part is None or isinstance(part, ClientHelloError)
