"""Request routing (:mod:`tailnet_agent.forward.http.routes`): the Ingress specification's path
examples, properties over generated paths, then the Gateway API's matches, precedence, weights,
redirects, rewrites and header edits."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tailnet_agent.contract.exposes import (
    EXACT,
    PREFIX,
    Backend,
    HeaderEdits,
    Match,
    PathChange,
    Redirect,
    Rewrite,
    Route,
    VirtualHost,
    WeightedBackend,
)
from tailnet_agent.forward.http.routes import (
    Forward,
    Reply,
    choose,
    decide,
    edit_headers,
    elements,
    matches,
    replace_path,
    request_path,
)

B = Backend(host="b", port=80)


def route(path: str, kind: str = PREFIX, port: int = 80) -> Route:
    return Route(path=path, type=kind, backend=Backend(host="b", port=port))


# The table "Examples" of the Ingress documentation (kubernetes.io, Ingress, path types).
@pytest.mark.parametrize(("kind", "path", "request_target", "match"), [
    (PREFIX, "/", "/", True), (PREFIX, "/", "/anything/at/all", True),
    (EXACT, "/foo", "/foo", True), (EXACT, "/foo", "/bar", False), (EXACT, "/foo", "/foo/", False),
    (EXACT, "/foo/", "/foo", False),
    (PREFIX, "/foo", "/foo", True), (PREFIX, "/foo", "/foo/", True),
    (PREFIX, "/foo/", "/foo", True), (PREFIX, "/foo/", "/foo/", True),
    (PREFIX, "/aaa/bb", "/aaa/bbb", False), (PREFIX, "/aaa/bbb", "/aaa/bbb", True),
    (PREFIX, "/aaa/bbb/", "/aaa/bbb", True), (PREFIX, "/aaa/bbb", "/aaa/bbb/", True),
    (PREFIX, "/aaa/bbb", "/aaa/bbb/ccc", True), (PREFIX, "/aaa/bbb", "/aaa/bbbxyz", False),
    (PREFIX, "/foo", "/foobar", False), (PREFIX, "/foo", "/foo/bar?x=/", True), (EXACT, "/foo", "/foo?a=b", True),
])
def test_the_ingress_specifications_examples(kind: str, path: str, request_target: str, match: bool) -> None:
    assert matches(route(path, kind), request_path(request_target)) is match
    assert (choose([route(path, kind)], request_target) is not None) is match


def test_the_longest_path_wins_and_exact_before_prefix_of_the_same_path() -> None:
    root, aaa, bbb, exact = route("/", port=1), route("/aaa", port=2), route("/aaa/bbb", port=3), \
        route("/aaa/bbb", EXACT, port=4)
    routes = [root, aaa, bbb, exact]
    assert choose(routes, "/aaa/bbb") is exact
    assert choose(routes, "/aaa/bbb/c") is bbb
    assert choose(routes, "/aaa/bb") is aaa
    assert choose(routes, "/zzz") is root
    assert choose([aaa, bbb], "/zzz") is None
    first = route("/a", port=1)
    assert choose([first, route("/a", port=2)], "/a/b") is first  # ties: the first listed

    # A prefix with a trailing slash has the same elements as the exact path: the exact one wins
    # (the Gateway API's conformance test HTTPRoutePathMatchOrder).
    match, slashed = route("/match", EXACT, port=5), route("/match/", port=6)
    assert choose([slashed, match], "/match") is match
    assert choose([slashed, match], "/match/any") is slashed


segment = st.text(alphabet="abc%._-", min_size=1, max_size=4)
paths = st.lists(segment, max_size=4).map(lambda parts: "/" + "/".join(parts))
targets = st.tuples(paths, st.booleans(), st.sampled_from(["", "?q=1", "?x=/a/b"])).map(
    lambda t: t[0] + ("/" if t[1] else "") + t[2])
routes_st = st.lists(st.tuples(paths, st.sampled_from([EXACT, PREFIX]), st.booleans()).map(
    lambda t: route(t[0] + ("/" if t[2] and t[0] != "/" else ""), t[1])), max_size=6)


@given(routes_st, targets)
def test_the_chosen_route_matches_and_none_that_matches_is_longer(routes: list[Route], target: str) -> None:
    chosen = choose(routes, target)
    path = request_path(target)
    matching = [r for r in routes if matches(r, path)]
    assert (chosen is None) == (not matching)
    if chosen is not None:
        assert matches(chosen, path)
        assert all(len(elements(r.path)) <= len(elements(chosen.path)) for r in matching)
        assert not any(r.type == EXACT for r in matching) or chosen.type == EXACT, "a matching Exact path wins"


@given(paths, segment, st.text(alphabet="abc", min_size=1, max_size=3))
def test_a_prefix_matches_by_element_never_within_one(base: str, last: str, more: str) -> None:
    prefix = base.rstrip("/") + "/" + last
    assert matches(route(prefix), prefix)
    assert matches(route(prefix), prefix + "/" + more)
    assert matches(route(prefix + "/"), prefix)
    assert not matches(route(prefix), prefix + more)


@given(targets)
def test_prefix_root_matches_every_path(target: str) -> None:
    assert choose([route("/")], target) is not None


# -- the Gateway API's additions: matches, precedence, weights, redirects, rewrites, header edits --

def rich(path: str = "/", kind: str = PREFIX, **kw: object) -> Route:
    kw.setdefault("backend", B)
    return Route(path=path, type=kind, **kw)  # type: ignore[arg-type]


def test_method_headers_and_query_must_all_match() -> None:
    want = rich("/a", method="POST", headers=(Match(name="X-Env", value="canary"),),
                query=(Match(name="v", value="2 x"),))
    assert choose([want], "/a/b?v=2+x&v=3", "POST", [("x-env", "canary")]) is want
    assert choose([want], "/a/b?v=2%20x", "POST", [("X-ENV", "canary")]) is want  # names without case, decoded
    assert choose([want], "/a/b?v=3&v=2+x", "POST", [("x-env", "canary")]) is None  # the first value counts
    assert choose([want], "/a/b?V=2+x", "POST", [("x-env", "canary")]) is None  # query names keep their case
    assert choose([want], "/a/b?v=2+x", "GET", [("x-env", "canary")]) is None
    assert choose([want], "/a/b?v=2+x", "POST", [("x-env", "Canary")]) is None  # values keep their case
    joined = rich("/", headers=(Match(name="accept", value="a, b"),))
    assert choose([joined], "/", "GET", [("Accept", "a"), ("accept", "b")]) is joined


def test_the_gateway_apis_precedence_after_the_path() -> None:
    """Longest path, Exact, a method, the most headers, the most query parameters, then the first listed."""
    headers = [("a", "1"), ("b", "2")]
    plain, method = rich("/x"), rich("/x", method="GET")
    one, two = rich("/x", headers=(Match(name="a", value="1"),)), \
        rich("/x", headers=(Match(name="a", value="1"), Match(name="b", value="2")))
    query = rich("/x", headers=(Match(name="a", value="1"), Match(name="b", value="2")),
                 query=(Match(name="q", value="1"),))
    longer = rich("/x/y")
    assert choose([plain, one, two, query, method], "/x?q=1", "GET", headers) is method
    assert choose([plain, one, two, query], "/x?q=1", "GET", headers) is query
    assert choose([plain, one, two], "/x?q=1", "GET", headers) is two
    assert choose([plain, one, two, longer], "/x/y", "GET", headers) is longer
    assert choose([one, plain], "/x", "GET", []) is plain


def decided(routes: tuple[Route, ...], target: str, *, method: str = "GET", headers: tuple[tuple[str, str], ...] = (),
            authority: str = "gw.example.test", port: int = 443, fallback: bool = True,
            rng: random.Random | None = None) -> Forward | Reply:
    host = VirtualHost(name="gw.example.test", cert_file="c", key_file="k", routes=routes, fallback=fallback)
    return decide(host, DEFAULT, method=method, target=target, authority=authority, headers=headers, port=port,
                  rng=rng)


DEFAULT = Backend(host="default", port=80)


def test_without_a_matching_route_the_expose_backend_or_404() -> None:
    assert decided((), "/x") == Forward(DEFAULT, "/x", "gw.example.test")
    assert decided((rich("/a"),), "/x") == Forward(DEFAULT, "/x", "gw.example.test")
    missed = decided((rich("/a"),), "/x?y", fallback=False)
    assert isinstance(missed, Reply) and missed.status == 404 and "matches /x," in missed.text
    # A host with no paths and no default backend (a Gateway listener no route is attached to yet)
    # forwards nothing: every request gets 404.
    idle = decided((), "/x", fallback=False)
    assert isinstance(idle, Reply) and idle.status == 404 and "matches /x," in idle.text


def test_weights_share_the_requests_and_zero_takes_none() -> None:
    left, right, idle = Backend(host="l", port=1), Backend(host="r", port=1), Backend(host="i", port=1)
    split = rich("/", backend=None, backends=(WeightedBackend(backend=left, weight=3),
                                              WeightedBackend(backend=right, weight=1),
                                              WeightedBackend(backend=idle, weight=0)))
    rng = random.Random(1)
    counts = Counter(d.backend for d in (decided((split,), "/", rng=rng) for _ in range(4000))
                     if isinstance(d, Forward))
    assert counts[idle] == 0 and sum(counts.values()) == 4000
    assert 2800 <= counts[left] <= 3200, counts  # 3000 expected, about 27 the deviation
    none = decided((rich("/", backend=None, backends=(WeightedBackend(backend=idle, weight=0),)),), "/")
    assert isinstance(none, Reply) and none.status == 500


@pytest.mark.parametrize(("prefix", "value", "target", "expected"), [
    # the Gateway API conformance suite's HTTPRouteRewritePath and HTTPRouteRedirectPath cases
    ("/prefix/one", "/one", "/prefix/one/two", "/one/two"),
    ("/strip-prefix", "/", "/strip-prefix/three", "/three"),
    ("/strip-prefix", "/", "/strip-prefix", "/"),
    ("/strip-prefix", "/", "/strip-prefix/", "/"),
    ("/foo", "/bar", "/foo/", "/bar/"),
    ("/foo", "/bar/", "/foo/x?q=1", "/bar/x?q=1"),
    ("/", "/root", "/a/b", "/root/a/b"),
    ("/a/b", "/c", "/a//b/d", "/c/d"),
])
def test_a_prefix_replacement_replaces_the_matched_elements(prefix: str, value: str, target: str,
                                                            expected: str) -> None:
    route = rich(prefix)
    assert replace_path(PathChange(type="ReplacePrefixMatch", value=value), route, target) == expected
    assert replace_path(PathChange(type="ReplaceFullPath", value="/one"), route, target) == \
        "/one" + ("?" + target.partition("?")[2] if "?" in target else "")


@pytest.mark.parametrize(("redirect", "port", "location"), [
    (Redirect(), 443, "https://gw.example.test/a/b?q=1"),
    (Redirect(), 8443, "https://gw.example.test:8443/a/b?q=1"),
    (Redirect(scheme="http"), 8443, "http://gw.example.test/a/b?q=1"),
    (Redirect(scheme="https"), 8443, "https://gw.example.test/a/b?q=1"),
    (Redirect(scheme="http", port=8080), 443, "http://gw.example.test:8080/a/b?q=1"),
    (Redirect(hostname="other.example.test", port=443), 8443, "https://other.example.test/a/b?q=1"),
    (Redirect(path=PathChange(type="ReplaceFullPath", value="/z")), 443, "https://gw.example.test/z?q=1"),
    (Redirect(path=PathChange(type="ReplacePrefixMatch", value="/z")), 443, "https://gw.example.test/z/b?q=1"),
])
def test_a_redirect_keeps_what_it_does_not_change(redirect: Redirect, port: int, location: str) -> None:
    reply = decided((rich("/a", backend=None, redirect=redirect),), "/a/b?q=1", authority="GW.example.test:1",
                    port=port)
    assert isinstance(reply, Reply) and reply.status == 302 and reply.headers == (("location", location),)


def test_a_rewrite_changes_what_the_backend_is_sent() -> None:
    edits = HeaderEdits(set=(Match(name="X-A", value="1"),))
    route = rich("/app", rewrite=Rewrite(hostname="inside.svc", path=PathChange(type="ReplacePrefixMatch", value="/")),
                 request_headers=edits)
    assert decided((route,), "/app/x?y=1") == Forward(B, "/x?y=1", "inside.svc", edits, HeaderEdits())


def test_header_edits_set_then_add_then_remove() -> None:
    edits = HeaderEdits(set=(Match(name="X-Set", value="new"),), add=(Match(name="X-Add", value="2"),),
                        remove=("x-gone", "X-ADD-NOT"))
    headers = [("x-set", "old"), ("X-Set", "older"), ("X-Add", "1"), ("X-Gone", "a"), ("x-gone", "b"), ("k", "v")]
    assert edit_headers(headers, edits) == [("X-Add", "1"), ("k", "v"), ("X-Set", "new"), ("X-Add", "2")]
    assert edit_headers(headers, HeaderEdits()) == headers
