"""Properties of render over generated base policies and CR sets."""

from __future__ import annotations

import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tailnet_operator.policy import (
    Derived,
    EgressInput,
    EgressTarget,
    GatewayInput,
    IngressInput,
    SiteInput,
    derive,
    missing,
    parse_hujson,
    render,
)

TAGS = ["tag:a", "tag:b", "tag:gw", "tag:r1", "tag:r2"]
ADDRESSES = ["10.0.0.1", "10.1.0.5", "100.64.0.3", "fd00::1", "db.example.com"]
ROUTES = ["10.0.0.0/16", "10.0.0.0/24", "10.0.0.1/32", "10.1.0.0/24", "192.168.1.0/24", "fd00::/64"]
PORTS = [22, 80, 443, 5432]
OWNERS = ["alice@", "group:platform", "tag:a"]

_json: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(["", "x", "http://a//b", "tag:a//b", "/* */"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("kKza"), inner, max_size=3),
    max_leaves=8,
)

_grant = st.fixed_dictionaries(
    {
        "src": st.lists(st.sampled_from([*TAGS, "*", "autogroup:tagged", "group:platform"]), min_size=1, max_size=2),
        "dst": st.lists(st.sampled_from([*ADDRESSES, *ROUTES, "*", "ledger", "tag:b"]), min_size=1, max_size=2),
        "ip": st.lists(st.sampled_from(["*", "tcp:443", "tcp:5432", "80-90", "udp:53", "tcp:*"]), min_size=1),
    },
    optional={"via": st.just(["tag:gw"]), "#note": st.just("kept")},
)
_acl = st.fixed_dictionaries(
    {
        "action": st.just("accept"),
        "src": st.lists(st.sampled_from([*TAGS, "*"]), min_size=1, max_size=2),
        "dst": st.lists(st.sampled_from(["*:*", "10.0.0.0/16:22", "tag:b:443", "10.1.0.5:5432"]), min_size=1),
    },
    optional={"proto": st.sampled_from(["tcp", "udp"])},
)
_blocks: dict[str, st.SearchStrategy[Any]] = {
    "tagOwners": st.dictionaries(st.sampled_from(TAGS), st.lists(st.sampled_from(OWNERS), max_size=2), max_size=3),
    "hosts": st.dictionaries(
        st.sampled_from(["db.example.com", "ledger"]),
        st.sampled_from(["10.0.0.9", "10.1.0.0/24"]),
    ),
    "acls": st.lists(_acl, max_size=2),
    "grants": st.lists(_grant, max_size=3),
    "autoApprovers": st.fixed_dictionaries(
        {},
        optional={
            "routes": st.dictionaries(st.sampled_from(ROUTES), st.lists(st.sampled_from(TAGS), max_size=2), max_size=3),
            "exitNode": st.lists(st.sampled_from(TAGS), max_size=1),
        },
    ),
    "groups": st.just({"group:platform": ["alice@"]}),
    "ssh": st.lists(st.fixed_dictionaries({"action": st.just("accept"), "x": _json}), max_size=1),
    "nodeAttrs": st.lists(st.fixed_dictionaries({"target": st.just(["*"]), "attr": st.just(["x"])}), max_size=1),
    "randomizeClientPort": st.booleans(),
    "tests": st.lists(st.fixed_dictionaries({"src": st.just("tag:a"), "accept": st.just(["tag:b:443"])}), max_size=1),
    "x-custom": _json,
}


@st.composite
def bases(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.permutations(list(_blocks)))
    chosen = names[: draw(st.integers(0, len(names)))]
    return {name: draw(_blocks[name]) for name in chosen}


_target = st.builds(
    EgressTarget, st.sampled_from(ADDRESSES), st.lists(st.sampled_from(PORTS), min_size=1, max_size=2).map(tuple)
)
_routes = st.lists(st.sampled_from(ROUTES), min_size=1, max_size=2, unique=True).map(tuple)


@st.composite
def cr_sets(draw: st.DrawFn) -> dict[str, list[Any]]:
    return {
        "egresses": draw(
            st.lists(
                st.builds(EgressInput, st.sampled_from(TAGS), st.lists(_target, min_size=1, max_size=3).map(tuple))
            )
        ),
        "ingresses": draw(st.lists(st.builds(IngressInput, st.sampled_from(TAGS), st.just((443,))), max_size=2)),
        "sites": draw(st.lists(st.builds(SiteInput, st.just("s"), st.sampled_from(TAGS), _routes), max_size=3)),
        "gateways": draw(
            st.lists(
                st.builds(GatewayInput, st.sampled_from(TAGS), st.sampled_from([(), ("10.250.0.0/24",)])), max_size=2
            )
        ),
    }


def _derived(crs: dict[str, list[Any]], owners: list[str]) -> Derived:
    return derive(**crs, owners=owners)


# Where a render may add members (objects) or items (lists); everywhere else the base is exact.
_GROWS = {(), ("tagOwners",), ("autoApprovers",), ("autoApprovers", "routes"), ("grants",)}


def _assert_preserved(base: Any, out: Any, path: tuple[Any, ...] = ()) -> None:
    assert type(out) is type(base), path
    if isinstance(base, dict):
        keys = list(out)
        assert keys[: len(base)] == list(base), path  # base keys first, in the base's order
        if path not in _GROWS:
            assert len(keys) == len(base), path
        for key, value in base.items():
            _assert_preserved(value, out[key], (*path, key))
    elif isinstance(base, list):
        assert len(out) >= len(base), path
        if path not in _GROWS:
            assert len(out) == len(base), path
        for index, item in enumerate(base):
            _assert_preserved(item, out[index], (*path, index))
    else:
        assert out == base, path


_owners = st.lists(st.sampled_from(OWNERS), max_size=2)
_props = settings(max_examples=200, deadline=None)


@_props
@given(bases(), cr_sets(), _owners)
def test_render_properties(base: dict[str, Any], crs: dict[str, list[Any]], owners: list[str]) -> None:
    """One generated case checks every property; generation dominates the cost, so it is shared."""
    derived = _derived(crs, owners)
    rendered = render(base, derived)

    # The base's content and key order are preserved; derived entries only follow them.
    _assert_preserved(base, rendered.document)

    # The output parses, as JSON and as HuJSON, to the document it claims to be.
    assert json.loads(rendered.text) == rendered.document
    assert parse_hujson(rendered.text) == rendered.document
    assert rendered.text.endswith("}\n")

    # Rendering twice is identical; rendering the render with the same CRs changes nothing.
    again = render(base, derived)
    assert (again.text, again.hash) == (rendered.text, rendered.hash)
    second = render(parse_hujson(rendered.text), derived)
    assert second.text == rendered.text
    assert second.added.empty

    # A render lacks only what it reported as skipped.
    report = missing(rendered.document, derived)
    assert report.tag_owners == ()
    assert {r.route for r in report.routes} <= {s.entry for s in rendered.skipped if s.kind == "route"}
    skipped_grants = {s.entry for s in rendered.skipped if s.kind == "grant"}
    assert all(f"{g.src[0]} -> {g.dst[0]} {', '.join(g.ip)}" in skipped_grants for g in report.grants)
    if report.empty:
        assert report.snippet == ""
    else:
        parse_hujson(report.snippet)


@settings(max_examples=100, deadline=None)
@given(bases(), cr_sets(), _owners, st.randoms(use_true_random=False))
def test_cr_order_does_not_matter(
    base: dict[str, Any], crs: dict[str, list[Any]], owners: list[str], rnd: random.Random
) -> None:
    shuffled = {kind: rnd.sample(items, len(items)) for kind, items in crs.items()}
    shuffled["egresses"] = [
        EgressInput(e.tag, tuple(rnd.sample(e.targets, len(e.targets)))) for e in shuffled["egresses"]
    ]
    assert render(base, _derived(shuffled, owners)).text == render(base, _derived(crs, owners)).text
