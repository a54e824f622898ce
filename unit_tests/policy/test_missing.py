"""Reporting what a live policy lacks, and deciding whether a write is needed."""

from __future__ import annotations

import json

import pytest

from tailnet_operator.policy import (
    EgressInput,
    EgressTarget,
    GatewayInput,
    Grant,
    IngressInput,
    PolicyParseError,
    RouteApproval,
    SiteInput,
    TagOwner,
    derive,
    diff_needed,
    missing,
    parse_hujson,
    render,
)

DERIVED = derive(
    egresses=[EgressInput("tag:egress", (EgressTarget("10.1.0.5", (5432,)), EgressTarget("db.example.com", (443,))))],
    ingresses=[IngressInput("tag:web", (443,))],
    sites=[SiteInput("branch", "tag:router", ("10.1.0.0/24",))],
    gateways=[GatewayInput("tag:gw")],
)


def test_everything_is_missing_from_an_empty_policy_with_rules() -> None:
    report = missing('{"grants": []}', DERIVED)
    assert report.tags == ("tag:egress", "tag:gw", "tag:router", "tag:web")
    assert report.routes == (
        RouteApproval("10.1.0.0/24", ("tag:router",)),
        RouteApproval("10.1.0.5/32", ("tag:gw",)),
    )
    assert report.grants == (
        Grant(("tag:egress",), ("10.1.0.5",), ("tcp:5432",)),
        Grant(("tag:egress",), ("db.example.com",), ("tcp:443",)),
    )
    assert not report.empty


def test_snippet_is_ready_to_paste_hujson() -> None:
    report = missing('{"grants": []}', DERIVED)
    assert report.snippet.startswith("// Added by tailnet-operator: policy entries")
    assert "// Note: db.example.com is a DNS name" in report.snippet
    pasted = parse_hujson(report.snippet)
    assert pasted == {
        "tagOwners": {"tag:egress": [], "tag:gw": [], "tag:router": [], "tag:web": []},
        "autoApprovers": {"routes": {"10.1.0.0/24": ["tag:router"], "10.1.0.5/32": ["tag:gw"]}},
        "grants": [
            {"src": ["tag:egress"], "dst": ["10.1.0.5"], "ip": ["tcp:5432"]},
            {"src": ["tag:egress"], "dst": ["db.example.com"], "ip": ["tcp:443"]},
        ],
    }


def test_no_policy_at_all_means_allow_all_so_no_grants_are_missing() -> None:
    lives: tuple[str | dict[str, object] | None, ...] = (None, "", {})
    for live in lives:
        report = missing(live, DERIVED)
        assert report.grants == ()
        assert len(report.tag_owners) == 4


def test_nothing_missing_gives_an_empty_report() -> None:
    live = {
        "hosts": {"db.example.com": "10.1.0.9"},
        "tagOwners": {"tag:egress": ["alice@"], "tag:gw": [], "tag:router": [], "tag:web": []},
        "autoApprovers": {"routes": {"10.0.0.0/8": ["tag:router", "tag:gw"]}},
        "grants": [{"src": ["tag:egress"], "dst": ["10.1.0.0/24", "db.example.com"], "ip": ["*"]}],
    }
    report = missing(json.dumps(live), DERIVED)
    assert report.empty
    assert report.snippet == ""
    assert report.notes == ()


def test_an_existing_route_without_the_approver_is_reported_with_a_note() -> None:
    live = {"grants": [], "autoApprovers": {"routes": {"10.1.0.0/24": ["tag:legacy"]}}}
    report = missing(live, derive(sites=[SiteInput("branch", "tag:router", ("10.1.0.0/24",))]))
    assert report.routes == (RouteApproval("10.1.0.0/24", ("tag:router",)),)
    assert report.notes == ("10.1.0.0/24 is already listed: add tag:router to its approvers",)
    assert report.tag_owners == (TagOwner("tag:router", ()),)


def test_unreadable_live_policy_is_an_error_for_the_report() -> None:
    with pytest.raises(PolicyParseError, match="live policy: line 1"):
        missing('{"tagOwners": oops}', DERIVED)


def test_render_lacks_only_what_it_skipped() -> None:
    rendered = render({"grants": []}, DERIVED)
    report = missing(rendered.text, DERIVED)
    assert report.grants == (Grant(("tag:egress",), ("db.example.com",), ("tcp:443",)),)
    assert [s.entry for s in rendered.skipped] == ["tag:egress -> db.example.com tcp:443"]
    assert report.tag_owners == () and report.routes == ()


# --- diff_needed -----------------------------------------------------------------------------


def test_same_data_in_another_format_needs_no_write() -> None:
    rendered = render({"grants": [], "x": {"a": 1, "b": [True, None]}}, DERIVED)
    reformatted = "// stored by hand\n" + json.dumps(json.loads(rendered.text)).replace(",", ",\n") + "\n"
    assert not diff_needed(rendered.text, rendered)
    assert not diff_needed(reformatted, rendered)
    assert not diff_needed(dict(reversed(list(rendered.document.items()))), rendered)  # key order is not data


def test_different_data_needs_a_write() -> None:
    base = {"grants": [{"src": ["*"], "dst": ["tag:web"], "ip": ["tcp:443"]}], "randomizeClientPort": True}
    rendered = render(base, DERIVED)
    changed = json.loads(rendered.text)
    changed["randomizeClientPort"] = False
    assert diff_needed(changed, rendered)
    reordered = json.loads(rendered.text)
    reordered["grants"].reverse()
    assert diff_needed(reordered, rendered)  # list order is data


def test_true_is_not_one() -> None:
    rendered = render({"x": True}, DERIVED)
    assert diff_needed({**rendered.document, "x": 1}, rendered)


def test_no_or_unreadable_live_policy_needs_a_write() -> None:
    rendered = render({}, DERIVED)
    assert diff_needed(None, rendered)
    assert diff_needed("", rendered)
    assert diff_needed("{oops", rendered)
