"""The node's pure projection of a netmap: data plane input (routes, peers, filter), home region, MagicDNS."""

from __future__ import annotations

from typing import Any

from tailnet_agent.control import netmap as nm
from tailnet_agent.projection import (
    choose_home_region,
    disco_peers,
    filter_rules,
    peer_routes,
    peer_specs,
    resolve_name,
    self_addresses,
)

KEY_A = "nodekey:" + "aa" * 32
KEY_B = "nodekey:" + "bb" * 32


def node(id: int, name: str, addrs: list[str], **extra: Any) -> dict[str, Any]:
    return {"ID": id, "Name": name, "Key": extra.pop("Key", KEY_A), "DiscoKey": "discokey:" + "cc" * 32,
            "Addresses": addrs, **extra}


def netmap(peers: list[dict[str, Any]], **extra: Any) -> nm.NetMap:
    doc: dict[str, Any] = {"Node": node(1, "agent.tailnet.test.", ["100.64.0.1/32", "fd7a:115c:a1e0::1/128"]),
                           "Peers": peers, "Domain": "tailnet.test", **extra}
    result = nm.apply(None, doc)
    assert result is not None
    return result


ROUTER = node(2, "router.tailnet.test.", ["100.64.0.2/32", "fd7a:115c:a1e0::2/128"], Key=KEY_B, HomeDERP=7,
              AllowedIPs=["100.64.0.2/32", "fd7a:115c:a1e0::2/128", "198.18.5.0/24", "0.0.0.0/0", "::/0"],
              PrimaryRoutes=["198.18.5.0/24"])


def test_self_addresses_one_per_family() -> None:
    assert self_addresses(netmap([])) == ["100.64.0.1/32", "fd7a:115c:a1e0::1/128"]


def test_routes_keep_own_addresses_and_add_subnets_only_with_accept_routes() -> None:
    peer = netmap([ROUTER]).peers[2]
    own = ["100.64.0.2/32", "fd7a:115c:a1e0::2/128"]
    assert [str(n) for n in peer_routes(peer, accept_routes=False)] == own
    assert [str(n) for n in peer_routes(peer, accept_routes=True)] == [*own, "198.18.5.0/24"]  # never exit routes


def test_allowed_ips_null_means_addresses() -> None:
    peer = netmap([node(3, "web.tailnet.test.", ["100.64.0.3/32"])]).peers[3]
    assert [str(n) for n in peer_routes(peer, accept_routes=True)] == ["100.64.0.3/32"]


def test_peer_specs_raw_keys_regions_and_skips() -> None:
    peers = [ROUTER,
             node(3, "web.tailnet.test.", ["100.64.0.3/32"]),  # no home DERP: falls back to ours
             node(4, "old.tailnet.test.", ["100.64.0.4/32"], Expired=True),
             node(5, "nodisco.tailnet.test.", ["100.64.0.5/32"], DiscoKey=""),  # neither disco key nor DERP
             node(6, "bad.tailnet.test.", ["100.64.0.6/32"], Key="nodekey:zz")]
    specs = peer_specs(netmap(peers), accept_routes=True, fallback_region=999)
    assert specs == [
        (bytes.fromhex("bb" * 32), ["100.64.0.2/32", "fd7a:115c:a1e0::2/128", "198.18.5.0/24"], 7),
        (bytes.fromhex("aa" * 32), ["100.64.0.3/32"], 999),
    ]


def test_filter_rules_in_data_plane_shape() -> None:
    rules = [{"SrcIPs": ["100.64.0.0/10", "cap:x"], "DstPorts": [{"IP": "*", "Ports": {"First": 22, "Last": 22}}],
              "IPProto": [6]},
             {"SrcIPs": ["*"], "DstPorts": [{"IP": "100.64.0.1", "Ports": {"First": 0, "Last": 65535}}]}]
    assert filter_rules(netmap([], PacketFilter=rules)) == [
        (["100.64.0.0/10", "cap:x"], [("*", 22, 22)], [6]),
        (["*"], [("100.64.0.1", 0, 65535)], []),
    ]
    assert filter_rules(netmap([])) == []


def test_home_region_is_the_lowest_usable_id() -> None:
    def dm(regions: dict[int, dict[str, Any]]) -> nm.DERPMap:
        return nm.DERPMap.from_json({"Regions": {str(k): {"RegionID": k, **v} for k, v in regions.items()}})

    usable = {"Nodes": [{"Name": "n", "RegionID": 0, "HostName": "derp"}]}
    assert choose_home_region(dm({999: usable, 5: usable})) == 5
    assert choose_home_region(dm({1: {**usable, "NoMeasureNoHome": True}, 3: usable})) == 3
    assert choose_home_region(dm({1: {"Nodes": [{"Name": "s", "HostName": "h", "STUNOnly": True}]}})) is None
    assert choose_home_region(dm({})) is None


def test_magicdns_names() -> None:
    m = netmap([ROUTER, node(3, "web.tailnet.test.", ["fd7a:115c:a1e0::3/128", "100.64.0.3/32"])])
    assert resolve_name(m, "web") == "100.64.0.3"  # IPv4 first
    assert resolve_name(m, "WEB.tailnet.test.") == "100.64.0.3"
    assert resolve_name(m, "router.tailnet.test") == "100.64.0.2"
    assert resolve_name(m, "agent") == "100.64.0.1"
    assert resolve_name(m, "nope") is None
    assert resolve_name(m, "web.other.test") is None
    assert resolve_name(m, "") is None


def test_disco_peers_take_ipv6_endpoints_only_for_a_dual_stack_socket() -> None:
    peer = node(2, "peer.tailnet.test.", ["100.64.0.2/32"], Key=KEY_B, HomeDERP=7,
                Endpoints=["198.18.0.5:41641", "[fd00::5]:41641", "[fe80::1%eth0]:1", "[fd00::5]:0", "junk"])
    [v4_only] = disco_peers(netmap([peer]), fallback_region=1)
    assert v4_only.endpoints == (("198.18.0.5", 41641),)
    [dual] = disco_peers(netmap([peer]), fallback_region=1, ipv6=True)
    assert dual.endpoints == (("198.18.0.5", 41641), ("fd00::5", 41641))
    assert dual.derp_region == 7
