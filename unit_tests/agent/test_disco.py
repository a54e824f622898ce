"""Disco messages and path rules between two in-memory nodes (real NaCl boxes, fake clock)."""

from __future__ import annotations

from collections.abc import Sequence

import nacl.public
import pytest

from tailnet_agent.disco import (
    HEARTBEAT_SECONDS,
    TRUST_SECONDS,
    Action,
    CallMeMaybe,
    Disco,
    DiscoPeer,
    NoteSource,
    Ping,
    Pong,
    SendDerp,
    SendUdp,
    SetDirect,
    decode,
    encode,
    open_packet,
    seal_packet,
)


class Side:
    def __init__(self, name: str, addr: tuple[str, int]) -> None:
        disco = nacl.public.PrivateKey.generate()
        self.private, self.public = bytes(disco), bytes(disco.public_key)
        self.node_key = bytes(nacl.public.PrivateKey.generate().public_key)
        self.addr = addr
        self.disco = Disco(self.private, self.public, self.node_key)
        self.disco.endpoints = (addr,)

    def as_peer(self, endpoints: tuple[tuple[str, int], ...] | None = None) -> DiscoPeer:
        return DiscoPeer(self.node_key, self.public, (self.addr,) if endpoints is None else endpoints, 999)


def pair() -> tuple[Side, Side]:
    a, b = Side("a", ("10.0.0.1", 41641)), Side("b", ("10.0.0.2", 41642))
    a.disco.set_peers([b.as_peer((b.addr,))])
    b.disco.set_peers([a.as_peer((a.addr,))])
    return a, b


def deliver(actions: Sequence[Action], sender: Side, receiver: Side, now: float) -> list[Action]:
    """Carry the sender's UDP/DERP sends to the receiver; return the receiver's answers."""
    out: list[Action] = []
    for action in actions:
        match action:
            case SendUdp(addr, packet) if addr == receiver.addr:
                out += receiver.disco.handle_udp(sender.addr, packet, now)
            case SendDerp(region, key, packet) if key == receiver.node_key:
                out += receiver.disco.handle_derp(region, sender.node_key, packet, now)
    return out


@pytest.mark.parametrize("message", [
    Ping(b"t" * 12, b"k" * 32), Ping(b"t" * 12), Pong(b"x" * 12, ("192.0.2.7", 41641)),
    Pong(b"x" * 12, ("2001:db8::1", 5)), CallMeMaybe((("10.0.0.1", 1), ("fd7a::2", 2))),
])
def test_messages_round_trip(message: Ping | Pong | CallMeMaybe) -> None:
    assert decode(encode(message)) == message


def test_wire_layout_matches_tailscale() -> None:
    # type, version, TxID, then the IPv4-mapped address and big-endian port.
    assert encode(Pong(bytes(range(12)), ("1.2.3.4", 0x1234))) == (
        b"\x02\x00" + bytes(range(12)) + b"\x00" * 10 + b"\xff\xff\x01\x02\x03\x04\x12\x34")
    assert decode(b"\x09\x00whatever") is None
    assert decode(b"\x02\x00short") is None


def test_sealed_packets_open_only_for_the_receiver() -> None:
    a, b = pair()
    packet = seal_packet(a.private, a.public, b.public, Ping(b"t" * 12, a.node_key))
    assert packet.startswith(b"TS\xf0\x9f\x92\xac" + a.public)
    assert open_packet(b.private, packet) == (a.public, Ping(b"t" * 12, a.node_key))
    assert open_packet(a.private, packet) is None
    assert open_packet(b.private, packet[:-1] + bytes([packet[-1] ^ 1])) is None


def test_ping_pong_sets_a_direct_path_both_ways() -> None:
    a, b = pair()
    pings = a.disco.tick(0.0, [b.node_key])
    assert any(isinstance(x, SendUdp) and x.addr == b.addr for x in pings)
    assert any(isinstance(x, SendDerp) for x in pings), "CallMeMaybe goes through DERP"
    answers = deliver(pings, a, b, 0.001)
    assert NoteSource(a.addr, a.node_key) in answers, "B learns where A's WireGuard comes from"
    results = deliver(answers, b, a, 0.002)
    assert SetDirect(b.node_key, b.addr) in results
    assert a.disco.direct_path(b.node_key) == b.addr


def test_a_path_without_pongs_falls_back_to_derp_after_the_trust_time() -> None:
    a, b = pair()
    deliver(deliver(a.disco.tick(0.0, [b.node_key]), a, b, 0.0), b, a, 0.0)
    assert a.disco.direct_path(b.node_key) == b.addr
    assert a.disco.direct_peers() == [b.node_key]
    heartbeat = a.disco.tick(HEARTBEAT_SECONDS, [b.node_key])
    assert [x for x in heartbeat if isinstance(x, SendUdp)], "heartbeat pings while in use"
    assert a.disco.tick(TRUST_SECONDS - 0.1, []) == [], "still trusted"
    assert SetDirect(b.node_key, None) in a.disco.tick(TRUST_SECONDS + 0.1, [])
    assert a.disco.direct_path(b.node_key) is None


def test_call_me_maybe_over_derp_makes_the_peer_ping_us() -> None:
    a, b = pair()
    b.disco.set_peers([a.as_peer(())])  # B knows no endpoint of A from the netmap
    cmm = [x for x in a.disco.tick(0.0, [b.node_key]) if isinstance(x, SendDerp)]
    pings = deliver(cmm, a, b, 0.0)
    assert [x.addr for x in pings if isinstance(x, SendUdp)] == [a.addr]


def test_strangers_and_mismatched_keys_are_ignored() -> None:
    a, b = pair()
    stranger = Side("c", ("10.0.0.3", 1))
    ping = seal_packet(stranger.private, stranger.public, b.public, Ping(b"t" * 12, stranger.node_key))
    assert b.disco.handle_udp(stranger.addr, ping, 0.0) == []
    lying = seal_packet(a.private, a.public, b.public, Ping(b"t" * 12, stranger.node_key))
    assert b.disco.handle_udp(a.addr, lying, 0.0) == [], "a ping naming another node key"
    over_derp = seal_packet(a.private, a.public, b.public, Ping(b"t" * 12, a.node_key))
    assert b.disco.handle_derp(999, stranger.node_key, over_derp, 0.0) == [], "relayed from another node"
    # A pong for a ping never sent does nothing.
    pong = seal_packet(b.private, b.public, a.public, Pong(b"n" * 12, a.addr))
    assert a.disco.handle_udp(b.addr, pong, 0.0) == []


def test_a_peer_leaving_the_netmap_drops_its_path() -> None:
    a, b = pair()
    deliver(deliver(a.disco.tick(0.0, [b.node_key]), a, b, 0.0), b, a, 0.0)
    assert a.disco.set_peers([]) == []
    assert a.disco.direct_path(b.node_key) is None


def test_a_peers_disco_key_is_checked_once_not_on_every_netmap(monkeypatch: pytest.MonkeyPatch) -> None:
    import tailnet_agent.disco as disco_module
    from tailnet_agent.derp import frames

    a, b = pair()
    c = Side("c", ("10.0.0.3", 41643))
    sealed: list[bytes] = []
    real_seal = frames.seal

    def counting_seal(private_key: bytes, peer_public: bytes, message: bytes) -> bytes:
        sealed.append(peer_public)
        return real_seal(private_key, peer_public, message)

    monkeypatch.setattr(disco_module, "seal", counting_seal)
    a.disco.set_peers([b.as_peer(), c.as_peer()])
    assert sealed == [c.public], "b was checked when it joined; only the new peer is"
    rekeyed = Side("b2", b.addr)
    a.disco.set_peers([DiscoPeer(b.node_key, rekeyed.public, (b.addr,), 999), c.as_peer()])
    assert sealed == [c.public, rekeyed.public], "a new disco key is checked again"


def direct(a: Side, b: Side) -> None:
    """A finds a direct path to B (B knows A, so it answers)."""
    b.disco.update_peers([a.as_peer()], [])
    deliver(deliver(a.disco.tick(0.0, [b.node_key]), a, b, 0.0), b, a, 0.0)
    assert a.disco.direct_path(b.node_key) == b.addr


def test_updating_some_peers_leaves_the_others_and_their_paths_alone() -> None:
    a, b = pair()
    c, d = Side("c", ("10.0.0.3", 41643)), Side("d", ("10.0.0.4", 41644))
    a.disco.update_peers([c.as_peer(), d.as_peer()], [])
    direct(a, b)
    direct(a, c)
    moved = DiscoPeer(b.node_key, b.public, (("10.0.9.2", 1),), 5)  # new endpoints and region, same disco key
    assert a.disco.update_peers([moved], [d.node_key]) == []
    assert a.disco.direct_path(b.node_key) == b.addr, "the same disco key keeps the path"
    assert a.disco.peers[b.node_key] == moved
    assert set(a.disco.peers) == {b.node_key, c.node_key}
    rekeyed = Side("c2", c.addr)
    assert a.disco.update_peers([DiscoPeer(c.node_key, rekeyed.public, (c.addr,), 999)], []) == [
        SetDirect(c.node_key, None)], "a new disco key is a new node: back to DERP"
    assert a.disco.direct_path(c.node_key) is None
    # Messages are matched to the new key only.
    ping = seal_packet(c.private, c.public, a.public, Ping(b"t" * 12, c.node_key))
    assert a.disco.handle_udp(c.addr, ping, 0.0) == []
    ping = seal_packet(rekeyed.private, rekeyed.public, a.public, Ping(b"t" * 12, c.node_key))
    assert NoteSource(c.addr, c.node_key) in a.disco.handle_udp(c.addr, ping, 0.0)


def test_a_removed_or_unusable_peer_is_forgotten_with_its_path() -> None:
    a, b = pair()
    c = Side("c", ("10.0.0.3", 41643))
    a.disco.update_peers([c.as_peer()], [])
    direct(a, b)
    direct(a, c)
    assert a.disco.update_peers([DiscoPeer(c.node_key, bytes(32), (), 999)], [b.node_key]) == []
    assert a.disco.peers == {}
    assert a.disco.direct_peers() == []
    ping = seal_packet(b.private, b.public, a.public, Ping(b"t" * 12, b.node_key))
    assert a.disco.handle_udp(b.addr, ping, 0.0) == [], "a removed peer's messages are a stranger's"


@pytest.mark.parametrize("incremental", [False, True])
def test_set_peers_and_update_peers_end_in_the_same_state(incremental: bool) -> None:
    a, b = pair()
    c, d = Side("c", ("10.0.0.3", 41643)), Side("d", ("10.0.0.4", 41644))
    a.disco.set_peers([b.as_peer(), c.as_peer()])
    direct(a, b)
    direct(a, c)
    rekeyed = Side("c2", c.addr)
    wanted = [DiscoPeer(c.node_key, rekeyed.public, (c.addr,), 999), d.as_peer()]
    actions = a.disco.update_peers(wanted, [b.node_key]) if incremental else a.disco.set_peers(wanted)
    assert actions == [SetDirect(c.node_key, None)]
    assert dict(a.disco.peers) == {p.node_key: p for p in wanted}
    assert a.disco.direct_peers() == []
