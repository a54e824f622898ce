"""The machine's addresses a node offers peers as UDP endpoints."""

from __future__ import annotations

from tailnet_agent.direct import endpoint_text
from tailnet_agent.netif import usable_ipv6_addresses

IF_INET6 = """\
00000000000000000000000000000001 01 80 10 80       lo
fd000000000000000000000000000002 04 40 00 82     eth0
fe8000000000000000fc00fffe000001 04 40 20 80     eth0
20010db8000000000000000000000007 05 40 00 40     eth1
20010db8000000000000000000000008 05 40 00 20     eth1
fd7a115ca1e000000000000000000003 06 80 00 80   tailscale0
20010db8000000000000000000000009 05 40 00 00     eth1
fd000000000000000000000000000002 07 40 00 00     eth2
not-an-address
"""


def test_only_global_addresses_a_peer_can_send_to_are_offered() -> None:
    # loopback, link-local, tentative (0x40), deprecated (0x20) and the tailnet's own range left out;
    # each address once
    assert usable_ipv6_addresses(IF_INET6) == ["fd00::2", "2001:db8::9"]


def test_endpoints_are_written_as_map_requests_carry_them() -> None:
    assert endpoint_text(("198.18.0.5", 41641)) == "198.18.0.5:41641"
    assert endpoint_text(("fd00::5", 41641)) == "[fd00::5]:41641"
