"""A netmap costs what it changed: after any sequence of map messages, what the node pushed to the
data plane and to disco piece by piece equals a full projection of the netmap."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, cast

import nacl.public

from tailnet_agent import _native as nat
from tailnet_agent.control import ControlOptions
from tailnet_agent.control import netmap as nm
from tailnet_agent.disco import DiscoPeer
from tailnet_agent.node import Node, NodeOptions
from tailnet_agent.projection import PeerChanges, PeerProjection, disco_peers, filter_rules, peer_specs


class FakeDataPlane:
    """What the node pushed into the data plane: the peers by node key with their rank, the filters."""

    def __init__(self) -> None:
        self.peers: dict[bytes, tuple[int, nat.PeerSpec]] = {}
        self.filters: list[list[nat.FilterRule]] = []
        self.calls: list[str] = []
        self.upserted: list[int] = []
        """The ranks (node ids) of every upsert, in order."""

    def set_self(self, addresses: Sequence[str]) -> None:
        self.calls.append("set_self")

    def set_peers(self, peers: Sequence[nat.PeerSpec]) -> None:
        raise AssertionError("the node pushes the peers that changed, never the whole set")

    def upsert_peers(self, peers: Sequence[tuple[int, nat.PeerSpec]]) -> None:
        self.calls.append("upsert_peers")
        assert peers, "an empty call is a wasted one"
        for rank, spec in peers:
            self.peers[spec[0]] = (rank, spec)
            self.upserted.append(rank)

    def remove_peers(self, keys: Sequence[bytes]) -> None:
        self.calls.append("remove_peers")
        for key in keys:
            del self.peers[key]  # a key the data plane does not hold is a bug of the diff

    def set_filter(self, rules: Sequence[nat.FilterRule]) -> None:
        self.calls.append("set_filter")
        self.filters.append(list(rules))

    def specs(self) -> list[nat.PeerSpec]:
        """The peers in rank order: how a full ``set_peers`` would have listed them."""
        return [spec for _, spec in sorted(self.peers.values(), key=lambda held: held[0])]


def key(prefix: str) -> str:
    return f"{prefix}:{bytes(nacl.public.PrivateKey.generate().public_key).hex()}"


def peer(node_id: int, **extra: Any) -> dict[str, Any]:
    return {"ID": node_id, "Name": f"peer{node_id}.tailnet.test.", "Key": key("nodekey"),
            "DiscoKey": key("discokey"), "Addresses": [f"100.64.0.{node_id}/32"],
            "Endpoints": [f"198.18.0.{node_id}:41641"], **extra}


def derp_map(*regions: int) -> dict[str, Any]:
    return {"Regions": {str(r): {"RegionID": r, "Nodes": [{"Name": f"{r}a", "RegionID": r, "HostName": "derp"}]}
                        for r in regions}}


RULES = [{"SrcIPs": ["*"], "DstPorts": [{"IP": "*", "Ports": {"First": 80, "Last": 80}}]}]
OTHER_RULES = [{"SrcIPs": ["100.64.0.0/10"], "DstPorts": [{"IP": "*", "Ports": {"First": 0, "Last": 65535}}]}]


def new_node() -> tuple[Node, FakeDataPlane]:
    node = Node(NodeOptions(control=ControlOptions(url="https://control.invalid", auth_key="k", hostname="agent"),
                            udp_port=None))
    fake = FakeDataPlane()
    node.dataplane = cast(nat.DataPlane, fake)
    return node, fake


def assert_matches_full_projection(node: Node, fake: FakeDataPlane) -> None:
    netmap = node.netmap
    assert netmap is not None
    assert fake.specs() == peer_specs(netmap, accept_routes=True, fallback_region=node.home_region)
    held = {p.node_key: p for p in disco_peers(netmap, fallback_region=node.home_region)}
    assert dict(node.disco.peers) == held
    assert fake.filters[-1] == filter_rules(netmap)


def test_each_message_pushes_only_what_it_changed_and_ends_where_a_full_projection_does() -> None:
    node, fake = new_node()
    router = peer(2, HomeDERP=7, AllowedIPs=["100.64.0.2/32", "10.2.0.0/16", "0.0.0.0/0"])
    steps: list[tuple[dict[str, Any], list[str]]] = [
        ({"Node": peer(1), "DERPMap": derp_map(1, 7), "PacketFilter": RULES,
          "Peers": [router, peer(3), peer(4, HomeDERP=7), peer(5, Expired=True)]},
         ["set_self", "upsert_peers", "set_filter"]),
        ({"PeersChanged": [peer(6)]}, ["upsert_peers"]),
        ({"OnlineChange": {"3": True}}, []),
        # Endpoints are disco's alone: the data plane's spec of peer 4 did not change.
        ({"PeersChangedPatch": [{"NodeID": 4, "Endpoints": ["198.18.9.4:1"]}]}, []),
        ({"PeersChangedPatch": [{"NodeID": 2, "DERPRegion": 1}]}, ["upsert_peers"]),
        ({"PeersChanged": [{**router, "AllowedIPs": ["100.64.0.2/32", "10.3.0.0/16"]}]}, ["upsert_peers"]),
        ({"PeersChangedPatch": [{"NodeID": 3, "Key": key("nodekey"), "DiscoKey": key("discokey")}]},
         ["remove_peers", "upsert_peers"]),
        ({"PeersRemoved": [4]}, ["remove_peers"]),
        ({"PacketFilter": RULES}, []),  # the same filter again is not compiled again
        ({"PacketFilter": OTHER_RULES}, ["set_filter"]),
        ({"PeersChanged": [{**peer(5), "Expired": False}]}, ["upsert_peers"]),
        # The home region leaves the DERP map: the peers without one of their own follow the new home.
        ({"DERPMap": derp_map(3, 7)}, ["upsert_peers"]),
    ]
    for message, calls in steps:
        fake.calls.clear()
        updated = nm.apply(node.netmap, message)
        assert updated is not None
        node._on_netmap(updated)
        assert fake.calls == calls, message
        assert_matches_full_projection(node, fake)
    assert node.home_region == 3


def test_a_full_peer_list_again_pushes_only_the_peers_that_differ() -> None:
    node, fake = new_node()
    peers = [peer(i, HomeDERP=1) for i in range(2, 12)]
    first = nm.apply(None, {"Node": peer(1), "DERPMap": derp_map(1), "Peers": peers})
    assert first is not None
    node._on_netmap(first)
    fake.upserted.clear()
    changed = {**peers[-1], "AllowedIPs": ["100.64.0.11/32", "10.11.0.0/16"]}
    again = nm.apply(first, {"Peers": [*peers[:-1], changed]})
    assert again is not None and all(again.peers[i] is not first.peers[i] for i in range(2, 12))
    node._on_netmap(again)
    assert fake.upserted == [11]
    assert_matches_full_projection(node, fake)


def test_a_new_disco_gets_every_peer() -> None:
    node, _ = new_node()
    first = nm.apply(None, {"Node": peer(1), "DERPMap": derp_map(1), "Peers": [peer(2), peer(3)]})
    assert first is not None
    node._on_netmap(first)
    node.direct.disco = node.direct.new_disco()  # what a new disco key does
    second = nm.apply(first, {"PeersChanged": [peer(4)]})
    assert second is not None
    node._on_netmap(second)
    assert set(node.disco.peers) == {p.node_key for p in disco_peers(second, fallback_region=1)}
    assert len(node.disco.peers) == 3


# -- the projection alone, over random messages ------------------------------------------------------


def apply_changes(changes: PeerChanges, specs: dict[bytes, tuple[int, nat.PeerSpec]],
                  disco: dict[bytes, DiscoPeer]) -> None:
    for removed in changes.removals:
        del specs[removed]
    for rank, spec in changes.upserts:
        specs[spec[0]] = (rank, spec)
    for removed in changes.disco_removals:
        del disco[removed]
    for disco_peer in changes.disco_upserts:
        disco[disco_peer.node_key] = disco_peer


def random_message(rng: random.Random, netmap: nm.NetMap) -> dict[str, Any]:
    ids = sorted(netmap.peers)
    choice = rng.randrange(6)
    if choice == 0 or not ids:
        return {"PeersChanged": [peer(rng.randrange(2, 60), HomeDERP=rng.choice([0, 1, 2]))]}
    target = rng.choice(ids)
    if choice == 1:
        return {"PeersRemoved": [target]}
    if choice == 2:
        return {"PeersChangedPatch": [{"NodeID": target, "DERPRegion": rng.choice([1, 2])}]}
    if choice == 3:
        return {"PeersChangedPatch": [{"NodeID": target, "Key": key("nodekey")}]}
    if choice == 4:
        subnet = [f"10.{rng.randrange(4)}.0.0/16"] if rng.random() < 0.7 else []
        return {"PeersChanged": [peer(target, AllowedIPs=[f"100.64.0.{target}/32", *subnet],
                                      Expired=rng.random() < 0.1, DiscoKey=rng.choice([key("discokey"), ""]))]}
    return {"OnlineChange": {str(target): rng.random() < 0.5}}


def test_random_messages_keep_the_pushed_state_equal_to_a_full_projection() -> None:
    rng = random.Random(27)
    projection = PeerProjection()
    specs: dict[bytes, tuple[int, nat.PeerSpec]] = {}
    disco: dict[bytes, DiscoPeer] = {}
    netmap = nm.apply(None, {"Node": peer(1), "Peers": [peer(i) for i in range(2, 20)]})
    assert netmap is not None
    for step in range(400):
        if step:
            netmap = nm.apply(netmap, random_message(rng, netmap))
            assert netmap is not None
        fallback, accept = (1, True) if step < 300 else (2, step % 2 == 0)
        changes = projection.update(netmap.peers, accept_routes=accept, fallback_region=fallback, ipv6=False)
        apply_changes(changes, specs, disco)
        full = peer_specs(netmap, accept_routes=accept, fallback_region=fallback)
        assert [spec for _, spec in sorted(specs.values(), key=lambda held: held[0])] == full, step
        assert disco == {p.node_key: p for p in disco_peers(netmap, fallback_region=fallback)}, step
        assert sorted(p.node_key for p in projection.disco_peers()) == sorted(disco)
