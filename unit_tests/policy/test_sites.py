from __future__ import annotations

from tailnet_operator.policy.sites import SiteRoutes, judge


def site(name: str, created: str, *routes: str) -> SiteRoutes:
    return SiteRoutes(name, created, routes)


def test_the_younger_of_two_overlapping_sites_is_blocked_naming_the_older() -> None:
    verdicts = judge([site("young", "2026-02-01T00:00:00Z", "192.168.50.0/25"),
                      site("old", "2026-01-01T00:00:00Z", "192.168.50.0/24")], [])
    assert not verdicts["old"].blocked
    assert verdicts["young"].blocked
    assert verdicts["young"].blocked_by == "TailnetSite old"
    assert "192.168.50.0/25" in verdicts["young"].message and "192.168.50.0/24" in verdicts["young"].message


def test_a_reserved_network_blocks_and_a_blocked_site_blocks_nobody() -> None:
    verdicts = judge([site("old", "2026-01-01T00:00:00Z", "10.96.1.0/24"),
                      site("young", "2026-02-01T00:00:00Z", "10.96.1.0/24")], ["10.96.0.0/12"])
    assert verdicts["old"].blocked_by == "reservedNetworks 10.96.0.0/12"
    assert verdicts["young"].blocked_by == "reservedNetworks 10.96.0.0/12"


def test_disjoint_sites_and_mixed_families_do_not_block() -> None:
    verdicts = judge([site("a", "2026-01-01T00:00:00Z", "192.168.1.0/24", "fd00::/64"),
                      site("b", "2026-01-01T00:00:00Z", "192.168.2.0/24", "192.168.1.5/32")], [])
    assert not verdicts["a"].blocked
    assert verdicts["b"].blocked and verdicts["b"].blocked_by == "TailnetSite a"


def test_deleting_the_older_site_unblocks_the_younger() -> None:
    both = [site("old", "2026-01-01T00:00:00Z", "192.168.50.0/24"),
            site("young", "2026-02-01T00:00:00Z", "192.168.50.10/32")]
    assert judge(both, [])["young"].blocked
    assert not judge(both[1:], [])["young"].blocked
