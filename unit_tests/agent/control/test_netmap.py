"""Applying full and delta MapResponses, and the length-prefixed map stream."""

from __future__ import annotations

import ipaddress
import json
import struct
from typing import Any

import pytest

from tailnet_agent.control import netmap as nm
from tailnet_agent.control.errors import ProtocolViolation
from tailnet_agent.control.mapstream import MapFrameDecoder, encode_frame


def node(node_id: int, ip: int, **extra: Any) -> dict[str, Any]:
    return {"ID": node_id, "StableID": f"s{node_id}", "Name": f"n{node_id}.tailnet.test.",
            "Key": f"nodekey:{node_id:064x}", "DiscoKey": f"discokey:{node_id:064x}",
            "Addresses": [f"100.64.0.{ip}/32", f"fd7a:115c:a1e0::{ip}/128"],
            "AllowedIPs": [f"100.64.0.{ip}/32", f"fd7a:115c:a1e0::{ip}/128"],
            "HomeDERP": 999, "Hostinfo": {"Hostname": f"host{node_id}"}, **extra}


FULL: dict[str, Any] = {
    "Node": node(1, 1, Tags=["tag:agent"], CapMap={"cap/a": None}),
    "DERPMap": {"Regions": {"999": {"RegionID": 999, "RegionCode": "local", "RegionName": "local", "Nodes": [
        {"Name": "999", "RegionID": 999, "HostName": "127.0.0.1", "IPv4": "127.0.0.1", "STUNPort": 3478,
         "DERPPort": 8443, "CanPort80": False}]}}},
    "Peers": [node(2, 2), node(3, 3, PrimaryRoutes=["10.0.0.0/24"], Online=True)],
    "PacketFilters": {"base": [{"SrcIPs": ["*"], "DstPorts": [{"IP": "*", "Ports": {"First": 0, "Last": 65535}}]}]},
    "DNSConfig": {"Resolvers": [{"Addr": "1.1.1.1"}], "Domains": ["tailnet.test"]},
    "Domain": "tailnet.test",
}


def full() -> nm.NetMap:
    result = nm.apply(None, FULL)
    assert result is not None
    return result


def test_full_response() -> None:
    m = full()
    assert [str(a) for a in m.self_node.addresses] == ["100.64.0.1/32", "fd7a:115c:a1e0::1/128"]
    assert m.self_node.tags == ("tag:agent",) and m.self_node.capabilities == ("cap/a",)
    assert set(m.peers) == {2, 3}
    p3 = m.peers[3]
    assert p3.primary_routes == (ipaddress.ip_network("10.0.0.0/24"),) and p3.online is True
    assert p3.home_derp == 999 and p3.hostname == "host3" and p3.key == f"nodekey:{3:064x}"
    region = m.derp_map.regions[999]
    assert region.region_code == "local"
    assert region.nodes[0].host_name == "127.0.0.1" and region.nodes[0].derp_port == 8443
    assert region.nodes[0].stun_port == 3478
    assert m.packet_filter[0].dst_ports[0].last == 65535
    assert m.dns.resolvers == ("1.1.1.1",) and m.domain == "tailnet.test"


def test_first_response_needs_the_self_node() -> None:
    with pytest.raises(nm.IncompleteMap):
        nm.apply(None, {"Peers": [node(2, 2)]})


def test_keepalive_changes_nothing() -> None:
    m = full()
    assert nm.apply(m, {"KeepAlive": True}) is m
    assert nm.apply(None, {"KeepAlive": True}) is None


def test_absent_fields_keep_their_values() -> None:
    m = full()
    after = nm.apply(m, {"PeersChanged": [node(4, 4)]})
    assert after is not None
    assert after.self_node == m.self_node and after.derp_map == m.derp_map
    assert after.packet_filters == m.packet_filters and after.dns == m.dns
    assert set(after.peers) == {2, 3, 4}


def test_peers_replaces_the_whole_set() -> None:
    after = nm.apply(full(), {"Peers": [node(5, 5)]})
    assert after is not None and set(after.peers) == {5}


def test_removed_changed_online_and_patch_in_order() -> None:
    after = nm.apply(full(), {
        "PeersRemoved": [2],
        "PeersChanged": [node(3, 30)],
        "OnlineChange": {"3": False},
        "PeersChangedPatch": [
            {"NodeID": 3, "DERPRegion": 7, "Endpoints": ["1.2.3.4:41641"], "Online": True,
             "DiscoKey": "discokey:" + "ff" * 32},
            {"NodeID": 99, "DERPRegion": 1},
        ],
    })
    assert after is not None
    assert set(after.peers) == {3}
    p3 = after.peers[3]
    assert p3.addresses[0] == ipaddress.ip_network("100.64.0.30/32")
    assert p3.home_derp == 7 and p3.endpoints == ("1.2.3.4:41641",) and p3.online is True
    assert p3.disco_key == "discokey:" + "ff" * 32 and p3.key == f"nodekey:{3:064x}"


def test_allowed_ips_null_means_addresses_and_legacy_derp() -> None:
    doc = node(6, 6, HomeDERP=0, DERP="127.3.3.40:12")
    del doc["AllowedIPs"]
    n = nm.Node.from_json(doc)
    assert n.allowed_ips is None and n.routable_ips == n.addresses and n.home_derp == 12


def test_a_peer_sent_again_shares_the_address_objects_already_held() -> None:
    """Headscale 0.29 resends every peer when one node joins; the addresses are parsed once."""
    m = full()
    after = nm.apply(m, {"PeersChanged": [node(2, 2), node(4, 4)]})
    assert after is not None
    assert all(a is b for a, b in zip(after.peers[2].addresses, m.peers[2].addresses, strict=True))
    assert all(a is b for a, b in zip(after.peers[2].addresses, after.peers[2].routable_ips, strict=True))
    assert after.peers[2].addresses != after.peers[4].addresses


@pytest.mark.parametrize("addresses", [["100.64.0.999/32"], [["100.64.0.2/32"]], [{"a": 1}], ["::g/128"]])
def test_an_address_that_does_not_parse_is_a_malformed_map_every_time(addresses: list[Any]) -> None:
    for _ in range(2):
        with pytest.raises(nm.MalformedMap):
            nm.apply(full(), {"PeersChanged": [node(7, 7, Addresses=addresses)]})


def test_packet_filter_rules() -> None:
    m = full()
    rule = {"SrcIPs": ["100.64.0.2"], "DstPorts": [{"IP": "100.64.0.1", "Ports": {"First": 80, "Last": 80}}],
            "IPProto": [6]}
    a = nm.apply(m, {"PacketFilter": [rule]})
    assert a is not None and a.packet_filters["base"][0].ip_proto == (6,)
    b = nm.apply(a, {"PacketFilters": {"extra": [rule]}})
    assert b is not None and set(b.packet_filters) == {"base", "extra"} and len(b.packet_filter) == 2
    c = nm.apply(b, {"PacketFilters": {"extra": None}})
    assert c is not None and set(c.packet_filters) == {"base"}
    d = nm.apply(b, {"PacketFilters": {"*": None, "new": [rule]}})
    assert d is not None and set(d.packet_filters) == {"new"}


def test_derp_map_update_replaces_regions() -> None:
    after = nm.apply(full(), {"DERPMap": {"Regions": {"1": {"RegionID": 1, "Nodes": [
        {"Name": "1a", "RegionID": 1, "HostName": "derp1.example", "CanPort80": True}]}}}})
    assert after is not None and set(after.derp_map.regions) == {1}
    assert after.derp_map.regions[1].nodes[0].can_port80


def test_map_frames_are_little_endian_length_prefixed_json() -> None:
    decoder = MapFrameDecoder()
    one = json.dumps({"KeepAlive": True}).encode()
    wire = struct.pack("<I", len(one)) + one + encode_frame(FULL)
    assert wire[:4] == bytes([len(one), 0, 0, 0])
    assert decoder.feed(wire[:3]) == []
    assert decoder.feed(wire[3:10]) == []
    messages = decoder.feed(wire[10:])
    assert messages == [{"KeepAlive": True}, json.loads(json.dumps(FULL))]
    assert decoder.buffered == 0


def test_map_frames_reject_garbage() -> None:
    with pytest.raises(ProtocolViolation):
        MapFrameDecoder().feed(struct.pack("<I", 1 << 30))
    with pytest.raises(ProtocolViolation):
        MapFrameDecoder().feed(struct.pack("<I", 4) + b"\x28\xb5\x2f\xfd")  # a zstd frame


def test_user_profiles_are_merged_by_id_and_peers_found_by_address() -> None:
    m = nm.apply(None, {**FULL, "Peers": [node(2, 2, User=7), node(3, 3, User=8, Tags=["tag:ci"])],
                        "UserProfiles": [{"ID": 7, "LoginName": "alice@example.com", "DisplayName": "Alice"},
                                         {"ID": 8, "LoginName": "tagged-devices", "DisplayName": "Tagged"}]})
    assert m is not None and m.peers[2].user == 7
    assert m.user_profiles[7] == nm.UserProfile(id=7, login_name="alice@example.com", display_name="Alice")
    later = nm.apply(m, {"UserProfiles": [{"ID": 7, "LoginName": "alice@example.com", "DisplayName": "Alice B"}]})
    assert later is not None and later.user_profiles[7].display_name == "Alice B" and 8 in later.user_profiles
    unchanged = nm.apply(later, {"PeersRemoved": [3]})
    assert unchanged is not None and set(unchanged.user_profiles) == {7, 8}, "absent profiles stay"
    assert later.peer_by_address("100.64.0.3") == later.peers[3]
    assert later.peer_by_address("fd7a:115c:a1e0::2") == later.peers[2]
    assert later.peer_by_address("100.64.0.9") is None and later.peer_by_address("not an ip") is None
