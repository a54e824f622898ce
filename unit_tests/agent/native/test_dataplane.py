"""Back-to-back tests of the native data plane (tailnet_agent._native)."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import time

import pytest

from tailnet_agent import _native as nat

from .harness import A_V4, B_V4, REGION, Node, Pair, frame, ipv4_packet


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tcp_connect_accept() -> None:
    pair = Pair(time.monotonic)
    listener = pair.b.dp.tcp_listen(8080)
    ha = pair.a.dp.tcp_connect(B_V4, 8080)
    pair.run_until(lambda: any(isinstance(e, nat.Connected) for e in pair.a.events))
    pair.run_until(lambda: any(isinstance(e, nat.Accepted) for e in pair.b.events))
    accepted = next(e for e in pair.b.events if isinstance(e, nat.Accepted))
    assert accepted.listener == listener
    assert accepted.remote_ip == A_V4
    local, remote = pair.a.dp.tcp_endpoints(ha)
    assert local is not None and local[0] == A_V4 and local[1] == accepted.remote_port
    assert remote == (B_V4, 8080)
    assert pair.b.dp.tcp_endpoints(accepted.handle)[1] == local
    assert pair.a.counters["wg_handshake_packets"] >= 1
    assert pair.b.counters["drop_filtered"] == 0


def test_ipv6_connect() -> None:
    pair = Pair(time.monotonic)
    pair.b.dp.tcp_listen(443)
    ha = pair.a.dp.tcp_connect("fd7a:115c:a1e0::2", 443)
    pair.run_until(lambda: any(isinstance(e, nat.Connected) and e.handle == ha for e in pair.a.events))
    accepted = next(e for e in pair.b.events if isinstance(e, nat.Accepted))
    assert accepted.remote_ip == "fd7a:115c:a1e0::1"


class Stream:
    """Drives one direction of a bulk transfer and hashes what arrives."""

    def __init__(self, sender: Node, send_handle: int, receiver: Node, recv_handle: int, data: bytes) -> None:
        self.sender, self.send_handle = sender, send_handle
        self.receiver, self.recv_handle = receiver, recv_handle
        self.data = data
        self.sent = 0
        self.received = 0
        self.digest = hashlib.sha256()

    def pump(self) -> None:
        while self.sent < len(self.data):
            n = self.sender.dp.tcp_send(self.send_handle, self.data[self.sent : self.sent + (1 << 20)])
            self.sent += n
            if n == 0:
                break
        while chunk := self.receiver.dp.tcp_recv(self.recv_handle, 1 << 20):
            self.received += len(chunk)
            self.digest.update(chunk)

    @property
    def done(self) -> bool:
        return self.received == len(self.data)


def test_bulk_64mib_each_direction() -> None:
    pair = Pair(time.monotonic)
    ha, hb = pair.connect()
    size = 64 << 20
    rng = random.Random(1234)
    a_to_b = Stream(pair.a, ha, pair.b, hb, rng.randbytes(size))
    b_to_a = Stream(pair.b, hb, pair.a, ha, rng.randbytes(size))
    started = time.perf_counter()
    steps = 0
    while not (a_to_b.done and b_to_a.done):
        a_to_b.pump()
        b_to_a.pump()
        pair.step()
        steps += 1
        assert steps < 2_000_000
    elapsed = time.perf_counter() - started
    assert a_to_b.digest.digest() == hashlib.sha256(a_to_b.data).digest()
    assert b_to_a.digest.digest() == hashlib.sha256(b_to_a.data).digest()
    for node in (pair.a, pair.b):
        assert not [e for e in node.events if isinstance(e, nat.Reset | nat.DialFailed)]
        assert node.counters["drop_filtered"] == 0
        assert node.counters["drop_wireguard"] == 0
    # Measurement only (shown with -s): both directions at once over one connection.
    mb = 2 * size / 1e6
    print(f"\nback-to-back: {mb:.0f} MB in {elapsed:.2f}s = {mb / elapsed:.1f} MB/s total, {steps} steps")


def test_half_close_reply_after_eof() -> None:
    pair = Pair(time.monotonic)
    ha, hb = pair.connect()
    request = b"GET / HTTP/1.0\r\n\r\n" * 1000
    assert pair.a.dp.tcp_send(ha, request) == len(request)
    pair.a.dp.tcp_shutdown_write(ha)
    with pytest.raises(BrokenPipeError, match="write side is closed"):
        pair.a.dp.tcp_send(ha, b"more")

    got = bytearray()

    def b_saw_eof() -> bool:
        if any(isinstance(e, nat.PeerClosed) and e.handle == hb for e in pair.b.events):
            return True
        got.extend(pair.b.dp.tcp_recv(hb))
        return False

    pair.run_until(b_saw_eof)
    assert bytes(got) == request

    reply = os.urandom(3 << 20)
    sent = 0
    received = bytearray()

    def a_got_reply() -> bool:
        nonlocal sent
        if sent < len(reply):
            sent += pair.b.dp.tcp_send(hb, reply[sent:])
            if sent == len(reply):
                pair.b.dp.tcp_shutdown_write(hb)
        # PeerClosed comes only once everything before the FIN was read; with both sides
        # shut, Closed follows in the same poll and releases the handle.
        if any(isinstance(e, nat.PeerClosed) and e.handle == ha for e in pair.a.events):
            return True
        received.extend(pair.a.dp.tcp_recv(ha, 1 << 20))
        return False

    pair.run_until(a_got_reply)
    assert bytes(received) == reply
    pair.run_until(
        lambda: (
            any(isinstance(e, nat.Closed) for e in pair.a.events)
            and any(isinstance(e, nat.Closed) for e in pair.b.events)
        )
    )
    for node in (pair.a, pair.b):
        assert not [e for e in node.events if isinstance(e, nat.Reset)]
    with pytest.raises(ValueError, match="unknown TCP handle"):
        pair.a.dp.tcp_recv(ha)
    pair.a.dp.tcp_close(ha)  # idempotent on a released handle


def test_dial_without_route_fails_with_reason() -> None:
    pair = Pair(time.monotonic)
    handle = pair.a.dp.tcp_connect("100.64.0.99", 80)
    pair.step()
    failed = [e for e in pair.a.events if isinstance(e, nat.DialFailed)]
    assert [e.handle for e in failed] == [handle]
    assert "no route to 100.64.0.99" in failed[0].reason
    assert pair.a.counters["packets_out"] == 0


def test_dial_refused_without_listener() -> None:
    pair = Pair(time.monotonic)
    handle = pair.a.dp.tcp_connect(B_V4, 9)
    pair.run_until(lambda: any(isinstance(e, nat.DialFailed) for e in pair.a.events))
    failed = next(e for e in pair.a.events if isinstance(e, nat.DialFailed))
    assert failed.handle == handle
    assert "refused" in failed.reason


def test_filter_drops_syn_and_dial_times_out() -> None:
    clock = FakeClock()
    pair = Pair(clock)
    pair.b.dp.set_filter([(["100.64.0.200/32", "cap:ignored"], [("*", 0, 65535)], [6])])
    pair.b.dp.tcp_listen(80)
    handle = pair.a.dp.tcp_connect(B_V4, 80, timeout=10.0)
    for _ in range(200):
        if any(isinstance(e, nat.DialFailed) for e in pair.a.events):
            break
        pair.step()
        result = pair.a.dp.poll(clock.now)
        assert result.next_deadline is not None
        # Jump straight to the next deadline, as an event loop sleeping on it would.
        clock.now = max(clock.now + 0.001, min(result.next_deadline, clock.now + 1.0))
    failed = [e for e in pair.a.events if isinstance(e, nat.DialFailed)]
    assert [e.handle for e in failed] == [handle]
    assert failed[0].reason == "connection timed out"
    assert clock.now >= 1010.0
    assert pair.b.counters["drop_filtered"] >= 1
    assert not [e for e in pair.b.events if isinstance(e, nat.Accepted)]


def test_filter_allows_matching_source_and_port() -> None:
    pair = Pair(time.monotonic)
    pair.b.dp.set_filter([([f"{A_V4}/32"], [(f"{B_V4}/32", 80, 80)], [])])
    pair.connect(80)
    ha = pair.a.dp.tcp_connect(B_V4, 81)  # no rule for 81
    pair.b.dp.tcp_listen(81)
    for _ in range(50):
        pair.step()
    assert not [e for e in pair.a.events if isinstance(e, nat.Connected) and e.handle == ha]
    assert pair.b.counters["drop_filtered"] >= 1


def test_tsmp_and_spoofed_source_are_dropped() -> None:
    pair = Pair(time.monotonic)
    pair.connect()  # establishes the WireGuard session
    before = dict(pair.b.counters)
    pair.a.dp.send_ip_packets(
        [
            ipv4_packet(99, A_V4, B_V4),  # TSMP
            ipv4_packet(17, "100.64.0.77", B_V4),  # source outside A's AllowedIPs
            ipv4_packet(17, "10.0.0.1", B_V4),
        ]
    )
    for _ in range(5):
        pair.step()
    after = pair.b.counters
    assert after["drop_tsmp"] - before["drop_tsmp"] == 1
    assert after["drop_spoofed_source"] - before["drop_spoofed_source"] == 2
    assert after["packets_in"] == before["packets_in"]


def test_set_peers_keeps_sessions() -> None:
    pair = Pair(time.monotonic)
    ha, hb = pair.connect()
    handshakes = pair.a.counters["wg_handshake_packets"] + pair.b.counters["wg_handshake_packets"]
    pair.a.dp.set_peers([(pair.b.dp.public_key, [f"{B_V4}/32", "10.9.0.0/16"], REGION)])
    assert pair.a.dp.tcp_send(ha, b"still here") == 10
    got = bytearray()

    def arrived() -> bool:
        got.extend(pair.b.dp.tcp_recv(hb))
        return bytes(got) == b"still here"

    pair.run_until(arrived)
    assert pair.a.counters["wg_handshake_packets"] + pair.b.counters["wg_handshake_packets"] == handshakes


def test_derp_control_frames() -> None:
    dp = nat.DataPlane(bytes(range(32)))
    key = bytes([7]) * 32
    stream = (
        frame(0x12, b"pingdata")
        + frame(0x06, b"")
        + frame(0x08, key + b"\x01")
        + frame(0x09, key)
        + frame(0x14, b"relay degraded")
        + frame(0x15, struct.pack(">II", 500, 9000))
        + frame(0x01, b"DERP\xf0\x9f\x94\x91" + key)
        + frame(0x42, b"future")
        + frame(0x05, key + b"not wireguard")  # from an unknown peer
    )
    # Split mid-header and mid-payload to exercise partial frames.
    for i in range(0, len(stream), 7):
        dp.derp_feed(3, stream[i : i + 7])
    result = dp.poll(1.0)
    assert result.derp_writes == [(3, frame(0x13, b"pingdata"))]
    events = result.events
    assert isinstance(events[0], nat.DerpPeerGone) and events[0].key == key and events[0].reason == 1
    assert isinstance(events[1], nat.DerpPeerPresent) and events[1].region == 3
    assert isinstance(events[2], nat.DerpHealth) and events[2].message == "relay degraded"
    match events[3]:
        case nat.DerpRestarting(region, reconnect, try_for):
            assert (region, reconnect, try_for) == (3, 500, 9000)
        case other:
            raise AssertionError(other)
    assert isinstance(events[4], nat.DerpFrame) and events[4].frame_type == 0x01
    assert isinstance(events[5], nat.DerpFrame) and events[5].payload == b"future"
    assert len(events) == 6
    assert result.counters["drop_unknown_peer"] == 1
    assert result.counters["derp_frames_in"] == 9
    with pytest.raises(ConnectionError, match="DERP region 3"):
        dp.derp_feed(3, b"\x05\xff\xff\xff\xff")


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="private_key must be 32 bytes"):
        nat.DataPlane(b"short")
    dp = nat.DataPlane(os.urandom(32))
    with pytest.raises(ValueError, match="invalid IP prefix"):
        dp.set_self(["100.64.0.1/40"])
    with pytest.raises(ValueError, match="at most one IPv4"):
        dp.set_self(["100.64.0.1/32", "100.64.0.2/32"])
    with pytest.raises(ValueError, match="peer node key must be 32 bytes"):
        dp.set_peers([(b"x", ["100.64.0.2/32"], 1)])
    with pytest.raises(ValueError, match="filter rule 0"):
        dp.set_filter([(["1.2.3.9-1.2.3.1"], [], [])])
    with pytest.raises(ValueError, match="invalid IP address"):
        dp.tcp_connect("not-an-ip", 80)
    dp.tcp_listen(80)
    with pytest.raises(OSError, match="already listening on port 80"):
        dp.tcp_listen(80)
    with pytest.raises(ValueError, match="invalid port 0"):
        dp.tcp_listen(0)
    with pytest.raises(ValueError, match="unknown TCP handle 12345"):
        dp.tcp_send(12345, b"x")
    with pytest.raises(ValueError, match="non-negative finite"):
        dp.poll(float("nan"))
