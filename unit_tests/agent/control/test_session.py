"""HTTP/2 over Noise records against an in-memory h2 server: early payload, requests, flow control."""

from __future__ import annotations

import json
import struct

import h2.config
import h2.connection
import h2.events

from tailnet_agent.control.keys import MACHINE_PUBLIC_PREFIX, PrivateKey
from tailnet_agent.control.noise import ClientHandshake, NoiseTransport
from tailnet_agent.control.session import (
    EARLY_PAYLOAD_MAGIC,
    ControlSession,
    EarlyPayload,
    Event,
    ResponseData,
    ResponseEnded,
    ResponseStarted,
)
from tailnet_agent.control.upgrade import parse_upgrade_response, upgrade_request

from .responder import respond


class FakeServer:
    """The server end of the pipe: a Noise responder and an h2 server connection."""

    def __init__(self, *, early: bool = True) -> None:
        control = PrivateKey.generate(MACHINE_PUBLIC_PREFIX)
        hs = ClientHandshake(PrivateKey.generate(MACHINE_PUBLIC_PREFIX), control.public.raw, 138)
        response, self.noise, _ = respond(control, hs.initiation)
        result = hs.receive_data(response)
        assert result is not None
        self.client_transport: NoiseTransport = result[0]
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.requests: dict[int, dict[str, str]] = {}
        self.bodies: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.early = b""
        if early:
            doc = json.dumps({"nodeKeyChallenge": "chalpub:" + "ab" * 32}).encode()
            self.early = EARLY_PAYLOAD_MAGIC + struct.pack(">I", len(doc)) + doc

    def first_bytes(self) -> bytes:
        return self.noise.encrypt(self.early + self.h2.data_to_send())

    def receive(self, wire: bytes) -> None:
        for ev in self.h2.receive_data(self.noise.receive_data(wire)):
            if isinstance(ev, h2.events.RequestReceived):
                self.requests[ev.stream_id or 0] = {str(k): str(v) for k, v in ev.headers or []}
            elif isinstance(ev, h2.events.DataReceived):
                sid = ev.stream_id or 0
                self.bodies[sid] = self.bodies.get(sid, b"") + (ev.data or b"")
                self.h2.acknowledge_received_data(ev.flow_controlled_length or 0, sid)
            elif isinstance(ev, h2.events.StreamEnded):
                self.ended.add(ev.stream_id or 0)

    def send(self) -> bytes:
        data = self.h2.data_to_send()
        return self.noise.encrypt(data) if data else b""


def pump(client: ControlSession, server: FakeServer) -> list[Event]:
    events: list[Event] = []
    for _ in range(50):
        to_server, to_client = client.data_to_send(), b""
        if to_server:
            server.receive(to_server)
        to_client = server.send()
        if not to_server and not to_client:
            break
        if to_client:
            events += client.receive_data(to_client)
    return events


def connect(*, early: bool = True) -> tuple[ControlSession, FakeServer, list[Event]]:
    server = FakeServer(early=early)
    client = ControlSession(server.client_transport, host="control.test")
    events = client.receive_data(server.first_bytes())
    return client, server, events + pump(client, server)


def test_early_payload_then_http2() -> None:
    _, _, events = connect()
    assert events[0] == EarlyPayload(node_key_challenge="chalpub:" + "ab" * 32)


def test_without_early_payload_http2_starts_at_once() -> None:
    client, server, events = connect(early=False)
    assert not any(isinstance(e, EarlyPayload) for e in events)
    sid = client.send_request("GET", "/x")
    pump(client, server)
    assert server.requests[sid][":path"] == "/x"


def test_request_headers_and_body_reach_the_server() -> None:
    client, server, _ = connect()
    body = json.dumps({"Version": 138, "pad": "p" * 100_000}).encode()  # larger than the initial window
    sid = client.send_request("POST", "/machine/register", body)
    pump(client, server)
    headers = server.requests[sid]
    assert headers[":method"] == "POST" and headers[":scheme"] == "https"
    assert headers[":authority"] == "control.test" and headers[":path"] == "/machine/register"
    assert headers["content-type"] == "application/json"
    assert server.bodies[sid] == body and sid in server.ended


def test_streamed_response_beyond_64k_is_acknowledged() -> None:
    client, server, _ = connect()
    sid = client.send_request("POST", "/machine/map", b"{}")
    pump(client, server)
    server.h2.send_headers(sid, [(":status", "200"), ("content-type", "application/json")])
    received = b""
    payload = b"m" * 16_000
    # 300 KB: with no WINDOW_UPDATEs from the client the server's window would hit zero at 64 KiB.
    for _ in range(20):
        assert server.h2.local_flow_control_window(sid) >= len(payload)
        server.h2.send_data(sid, payload)
        for ev in pump(client, server):
            if isinstance(ev, ResponseData):
                received += ev.data
    server.h2.end_stream(sid)
    events = pump(client, server)
    assert received == payload * 20
    assert ResponseEnded(stream_id=sid) in events


def test_response_status_and_headers() -> None:
    client, server, _ = connect()
    sid = client.send_request("GET", "/missing")
    pump(client, server)
    server.h2.send_headers(sid, [(":status", "404"), ("x-a", "b")], end_stream=True)
    events = pump(client, server)
    assert ResponseStarted(stream_id=sid, status=404, headers={"x-a": "b"}) in events
    assert ResponseEnded(stream_id=sid) in events


def test_upgrade_request_and_response_parsing() -> None:
    init = bytes(range(101))
    req = upgrade_request("127.0.0.1:8080", init).decode()
    assert req.startswith("POST /ts2021 HTTP/1.1\r\n")
    assert "Upgrade: tailscale-control-protocol\r\n" in req and "Connection: upgrade\r\n" in req
    import base64
    assert f"X-Tailscale-Handshake: {base64.b64encode(init).decode()}\r\n" in req
    head = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: tailscale-control-protocol\r\nConnection: upgrade\r\n\r\n"
    assert parse_upgrade_response(head[:20]) is None
    parsed = parse_upgrade_response(head + b"\x02\x00\x30rest")
    assert parsed is not None and parsed.status == 101
    assert parsed.headers["upgrade"] == "tailscale-control-protocol"
    assert parsed.leftover == b"\x02\x00\x30rest"
