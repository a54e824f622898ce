"""Rendering: the base wins, nothing is removed or reordered, derived entries are appended."""

from __future__ import annotations

import json
from typing import Any

from tailnet_operator.policy import (
    Derived,
    EgressInput,
    EgressTarget,
    GatewayInput,
    Grant,
    IngressInput,
    RouteApproval,
    SiteInput,
    TagOwner,
    derive,
    parse_hujson,
    render,
)

BASE = """// The platform team's policy.
{
  "randomizeClientPort": true,
  "groups": {"group:platform": ["alice@"]},
  "hosts": {"ledger": "10.9.0.7/32"},
  "tagOwners": {
    "tag:egress-db": ["group:platform"], // hand-owned: the base wins
  },
  "acls": [{"action": "accept", "src": ["group:platform"], "dst": ["tag:web:443"]}],
  "ssh": [{"action": "accept", "src": ["group:platform"], "dst": ["tag:web"], "users": ["root"]}],
  "nodeAttrs": [{"target": ["*"], "attr": ["funnel"]}],
  "x-custom": {"note": "http://wiki.example.com//policy", "n": 1},
  "grants": [
    {"src": ["group:platform"], "dst": ["tag:web"], "ip": ["tcp:443"]},
  ],
  "tests": [{"src": "alice@", "accept": ["tag:web:443"]}],
}
"""

EGRESS = EgressInput("tag:egress-db", (EgressTarget("10.1.0.5", (5432,)),))
SITE = SiteInput("branch", "tag:router", ("10.1.0.0/24",))
INGRESS = IngressInput("tag:web", (443,))


def test_unknown_blocks_pass_through_in_place_and_nothing_is_reordered() -> None:
    base = parse_hujson(BASE)
    rendered = render(base, derive(egresses=[EGRESS], sites=[SITE], ingresses=[INGRESS]))
    doc = rendered.document
    assert list(doc) == [*base, "autoApprovers"]
    for key in ("randomizeClientPort", "groups", "hosts", "acls", "ssh", "nodeAttrs", "x-custom", "tests"):
        assert doc[key] == base[key]
    assert list(doc["tagOwners"]) == ["tag:egress-db", "tag:router", "tag:web"]
    assert doc["grants"][0] == base["grants"][0]


def test_base_wins_on_a_tag_owner_conflict() -> None:
    rendered = render(parse_hujson(BASE), derive(egresses=[EGRESS], owners=["alice@"]))
    assert rendered.document["tagOwners"]["tag:egress-db"] == ["group:platform"]
    assert rendered.added.tag_owners == ()


def test_missing_blocks_are_appended_in_a_fixed_order() -> None:
    base = {"acls": [], "x-last": 1}
    rendered = render(base, derive(egresses=[EGRESS], sites=[SITE], gateways=[GatewayInput("tag:gw")]))
    assert list(rendered.document) == ["acls", "x-last", "tagOwners", "autoApprovers", "grants"]
    assert rendered.document["autoApprovers"] == {
        "routes": {"10.1.0.0/24": ["tag:router"], "10.1.0.5/32": ["tag:gw"]}
    }
    assert rendered.document["grants"] == [{"src": ["tag:egress-db"], "dst": ["10.1.0.5"], "ip": ["tcp:5432"]}]


def test_empty_derived_changes_nothing_and_adds_no_empty_blocks() -> None:
    base = parse_hujson(BASE)
    rendered = render(base, Derived())
    assert rendered.document == base
    assert rendered.added.empty
    assert render({}, Derived()).text == "{}\n"


def test_auto_approvers_merge_base_wins_on_an_existing_route() -> None:
    base = {
        "grants": [],
        "autoApprovers": {
            "exitNode": ["tag:exit"],
            "routes": {"10.1.0.0/24": ["tag:legacy-router"], "10.2.0.0/16": ["tag:wide"]},
        },
    }
    derived = derive(
        sites=[SITE, SiteInput("covered", "tag:wide", ("10.2.3.0/24",)), SiteInput("new", "tag:r3", ("10.3.0.0/24",))]
    )
    rendered = render(base, derived)
    auto = rendered.document["autoApprovers"]
    assert list(auto) == ["exitNode", "routes"]
    assert auto["routes"] == {
        "10.1.0.0/24": ["tag:legacy-router"],  # base wins, the router tag is not appended
        "10.2.0.0/16": ["tag:wide"],
        "10.3.0.0/24": ["tag:r3"],  # 10.2.3.0/24 is approved through 10.2.0.0/16 already
    }
    assert rendered.added.routes == (RouteApproval("10.3.0.0/24", ("tag:r3",)),)
    [skip] = rendered.skipped
    assert (skip.kind, skip.entry) == ("route", "10.1.0.0/24")
    assert "tag:router" in skip.reason and "base wins" in skip.reason


def test_existing_route_written_differently_is_still_the_same_route() -> None:
    base = {"autoApprovers": {"routes": {"FD00:1::/64": ["tag:r"]}}}
    rendered = render(base, derive(sites=[SiteInput("v6", "tag:r", ("fd00:1::/64",))]))
    assert rendered.document["autoApprovers"] == base["autoApprovers"]
    assert rendered.skipped == ()


def test_autoapprovers_without_routes_gets_a_routes_member() -> None:
    rendered = render({"autoApprovers": {"exitNode": []}}, derive(sites=[SITE]))
    assert rendered.document["autoApprovers"] == {"exitNode": [], "routes": {"10.1.0.0/24": ["tag:router"]}}


def test_block_names_are_found_case_insensitively() -> None:
    rendered = render({"TagOwners": {}, "AutoApprovers": {"Routes": {}}}, derive(sites=[SITE]))
    assert rendered.document == {
        "TagOwners": {"tag:router": []},
        "AutoApprovers": {"Routes": {"10.1.0.0/24": ["tag:router"]}},
    }


def test_grants_are_deduplicated() -> None:
    existing = {"ip": ["tcp:5432"], "src": ["tag:egress-db"], "dst": ["10.1.0.5"]}
    rendered = render({"grants": [existing]}, derive(egresses=[EGRESS]))
    assert rendered.document["grants"] == [existing]
    assert rendered.added.grants == ()


def test_grants_already_given_more_widely_are_not_repeated() -> None:
    egress = EgressInput(
        "tag:e",
        (
            EgressTarget("10.1.0.5", (5432, 443)),
            EgressTarget("10.9.0.7", (22,)),
            EgressTarget("100.64.0.3", (80,)),
            EgressTarget("10.7.0.1", (8080,)),
        ),
    )
    base = {
        "hosts": {"ledger": "10.9.0.7/32"},
        "grants": [
            {"src": ["autogroup:tagged"], "dst": ["10.1.0.0/24"], "ip": ["tcp:5432"]},
            {"src": ["tag:e"], "dst": ["10.1.0.5"], "ip": ["400-500"]},
            {"src": ["*"], "dst": ["ledger"], "ip": ["*"]},
            {"src": ["tag:e"], "dst": ["*"], "ip": ["tcp:80"]},  # "*" is the tailnet ranges only
        ],
        "acls": [{"action": "accept", "src": ["tag:e"], "dst": ["10.7.0.0/16:8000-9000"]}],
    }
    rendered = render(base, derive(egresses=[egress]))
    assert rendered.added.grants == ()


def test_grants_not_given_are_added_conservatively() -> None:
    base: dict[str, Any] = {
        "grants": [
            {"src": ["group:platform"], "dst": ["10.1.0.5"], "ip": ["*"]},  # users never match tagged nodes
            {"src": ["tag:egress-db"], "dst": ["10.1.0.5"], "ip": ["udp:5432"]},
            {"src": ["tag:egress-db"], "dst": ["*"], "ip": ["*"]},  # 10.1.0.5 is not in the tailnet ranges
            {"src": ["tag:egress-db"], "dst": ["10.1.0.5"], "ip": ["*"], "via": ["tag:gw"]},
        ],
        "acls": [{"action": "accept", "proto": "udp", "src": ["tag:egress-db"], "dst": ["10.1.0.5:*"]}],
    }
    rendered = render(base, derive(egresses=[EGRESS]))
    assert rendered.added.grants == (Grant(("tag:egress-db",), ("10.1.0.5",), ("tcp:5432",)),)
    assert rendered.document["grants"][:4] == base["grants"]


def test_allow_all_base_gets_no_grants() -> None:
    rendered = render({"tagOwners": {}}, derive(egresses=[EGRESS]))
    assert "grants" not in rendered.document
    assert [s.kind for s in rendered.skipped] == ["grant"]
    assert "allows all traffic" in rendered.skipped[0].reason
    assert rendered.document["tagOwners"] == {"tag:egress-db": []}


def test_acls_only_base_gets_a_grants_block() -> None:
    rendered = render({"acls": []}, derive(egresses=[EGRESS]))
    assert rendered.document["grants"] == [{"src": ["tag:egress-db"], "dst": ["10.1.0.5"], "ip": ["tcp:5432"]}]


def test_dns_name_targets_need_a_hosts_entry() -> None:
    egress = EgressInput("tag:e", (EgressTarget("db.example.com", (5432,)),))
    skipped = render({"grants": []}, derive(egresses=[egress]))
    assert skipped.document["grants"] == []
    assert '"hosts": {"db.example.com": "<its IP>"}' in skipped.skipped[0].reason

    defined = render({"hosts": {"db.example.com": "10.1.0.5"}, "grants": []}, derive(egresses=[egress]))
    assert defined.document["grants"] == [{"src": ["tag:e"], "dst": ["db.example.com"], "ip": ["tcp:5432"]}]
    assert defined.skipped == ()


def test_ingress_contributes_its_tag_only() -> None:
    rendered = render({"grants": []}, derive(ingresses=[INGRESS]))
    assert rendered.document == {"grants": [], "tagOwners": {"tag:web": []}}


def test_text_is_canonical_and_hashed() -> None:
    rendered = render(parse_hujson(BASE), derive(egresses=[EGRESS], sites=[SITE]))
    assert rendered.text == json.dumps(rendered.document, indent=2, ensure_ascii=False) + "\n"
    assert json.loads(rendered.text) == rendered.document
    assert parse_hujson(rendered.text) == rendered.document
    assert len(rendered.hash) == 64
    assert "//" not in rendered.text.replace("http://wiki.example.com//policy", "")


def test_render_does_not_touch_its_input() -> None:
    base = parse_hujson(BASE)
    snapshot = json.dumps(base)
    render(base, derive(egresses=[EGRESS], sites=[SITE], owners=["alice@"]))
    assert json.dumps(base) == snapshot


def test_render_of_the_render_changes_nothing() -> None:
    derived = derive(egresses=[EGRESS], sites=[SITE], ingresses=[INGRESS], gateways=[GatewayInput("tag:gw")])
    first = render(parse_hujson(BASE), derived)
    second = render(parse_hujson(first.text), derived)
    assert second.text == first.text
    assert second.added.empty


def test_added_reports_what_was_appended() -> None:
    rendered = render(parse_hujson(BASE), derive(egresses=[EGRESS], sites=[SITE]))
    assert rendered.added.tag_owners == (TagOwner("tag:router", ()),)
    assert rendered.added.routes == (RouteApproval("10.1.0.0/24", ("tag:router",)),)
    assert rendered.added.grants == (Grant(("tag:egress-db",), ("10.1.0.5",), ("tcp:5432",)),)
