"""Path routing as the Ingress defines it (:mod:`tailnet_agent.forward.http.routes`): the
specification's examples, then properties over generated paths."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tailnet_agent.contract.exposes import EXACT, PREFIX, Backend, Route
from tailnet_agent.forward.http.routes import choose, elements, matches, request_path

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
        assert not any(r.type == EXACT and r.path == chosen.path and chosen.type == PREFIX for r in matching)


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
