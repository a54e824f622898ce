"""Request routing, as the Kubernetes Ingress and the Gateway API's HTTPRoute define it: pure, no I/O.

A host's routes (:class:`~tailnet_agent.contract.exposes.Route`) are matched against the request's
path without its query or fragment, as the client sent it (not percent-decoded):

* ``Exact`` matches the path exactly (``/foo`` does not match ``/foo/``);
* ``Prefix`` matches by path element: the path split on ``/``, empty elements ignored, must begin
  with the route's elements (``/foo`` and ``/foo/`` match ``/foo``, ``/foo/`` and ``/foo/bar``,
  never ``/foobar``; ``/`` matches every path).

A route may further require a method, headers (names without case; a header sent more than once is
its values joined by ``, ``, as RFC 9110 combines them) and query parameters (names with case,
values percent-decoded, the first value of a name), each with exactly the value given.

Of the routes that match, the one with the longest path wins (counted in elements, then in
characters); then ``Exact`` before ``Prefix``; then one that requires a method; then the most
header matches; then the most query matches; of routes still tied, the first listed (the
Gateway API's precedence; its later tie-breakers, a route's age and name, are the order the
operator lists them in). None when no route matches: the caller decides (the expose's backend,
or 404).

:func:`decide` turns the chosen route into what happens to the request: a :class:`Forward` to one
of its backends (chosen by weight; the path and Host rewritten, the headers to edit), or a
:class:`Reply` the agent gives itself (a redirect, 404 with no route, 500 when every backend of
the route has weight 0).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from tailnet_agent.contract.exposes import (
    EXACT,
    REPLACE_FULL_PATH,
    Backend,
    HeaderEdits,
    PathChange,
    Redirect,
    Route,
    VirtualHost,
)

from .headers import host_of

__all__ = ["Forward", "Reply", "choose", "decide", "edit_headers", "elements", "matches", "replace_path",
           "request_path"]

Headers = list[tuple[str, str]]


def request_path(target: str) -> str:
    """The path of a request target (``/a/b?q=1`` -> ``/a/b``); ``/`` for an empty one."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    return path or "/"


def request_query(target: str) -> str:
    """The query of a request target, without ``?`` (``/a?q=1#f`` -> ``q=1``)."""
    return target.partition("#")[0].partition("?")[2]


def elements(path: str) -> list[str]:
    """The path's elements: split on ``/``, empty ones dropped (``/a//b/`` -> ``["a", "b"]``)."""
    return [e for e in path.split("/") if e]


class _Request:
    """What the routes are matched against: the path at once, the headers and the query when a
    route first asks for them (most routes match on the path alone), each once per request."""

    def __init__(self, target: str, method: str, headers: Iterable[tuple[str, str]]) -> None:
        self.target = target
        self.path = request_path(target)
        self.parts = tuple(elements(self.path))
        self.method = method.upper()
        self._headers = headers

    @functools.cached_property
    def headers(self) -> dict[str, str]:
        """By lower-case name, a repeated header's values joined by ``, ``."""
        combined: dict[str, list[str]] = {}
        for name, value in self._headers:
            combined.setdefault(name.lower(), []).append(value)
        return {k: ", ".join(v) for k, v in combined.items()}

    @functools.cached_property
    def query(self) -> dict[str, str]:
        """By name, the first value, percent-decoded."""
        query: dict[str, str] = {}
        for name, value in parse_qsl(request_query(self.target), keep_blank_values=True):
            query.setdefault(name, value)
        return query


def matches(route: Route, path: str) -> bool:
    """Whether ``route``'s path matches the request path ``path`` (no query)."""
    return _path_matches(route, path, tuple(elements(path)))


def _path_matches(route: Route, path: str, parts: tuple[str, ...]) -> bool:
    if route.type == EXACT:
        return path == route.path
    want = _route_elements(route.path)
    return parts[:len(want)] == want


def _matches(route: Route, request: _Request) -> bool:
    return (_path_matches(route, request.path, request.parts)
            and (route.method is None or route.method == request.method)
            and all(request.headers.get(m.name.lower()) == m.value for m in route.headers)
            and all(request.query.get(m.name) == m.value for m in route.query))


@functools.lru_cache(maxsize=4096)
def _route_elements(path: str) -> tuple[str, ...]:
    """A route's elements, split once per route path rather than once per request."""
    return tuple(elements(path))


def _rank(route: Route) -> tuple[int, bool, int, bool, int, int]:
    """Higher wins among matching routes: more path elements; an Exact path (one that matches has
    every element of the request, so no matching prefix has more, and a prefix ``/a/`` ties with
    ``/a``); more characters; a method; more header, then query, matches. The Gateway API's order
    and the Ingress API's."""
    return (len(_route_elements(route.path)), route.type == EXACT, len(route.path), route.method is not None,
            len(route.headers), len(route.query))


def choose(routes: Sequence[Route], target: str, method: str = "GET",
           headers: Iterable[tuple[str, str]] = ()) -> Route | None:
    """The route a request for ``target`` (path, maybe with a query) goes to; None when none matches."""
    request = _Request(target, method, headers)
    best: Route | None = None
    for route in routes:
        if _matches(route, request) and (best is None or _rank(route) > _rank(best)):
            best = route
    return best


# -- what happens to the request ------------------------------------------------------------------

@dataclass(frozen=True)
class Forward:
    """Send the request to ``backend`` as ``target`` (path and query) for ``authority`` (the Host
    the backend gets), with the route's header edits (none without a route)."""

    backend: Backend
    target: str
    authority: str
    request_edits: HeaderEdits = field(default_factory=HeaderEdits)
    response_edits: HeaderEdits = field(default_factory=HeaderEdits)


@dataclass(frozen=True)
class Reply:
    """An answer the agent gives itself, without asking a backend."""

    status: int
    text: str
    headers: tuple[tuple[str, str], ...] = ()


_RNG = random.Random()
"""Chooses among a route's weighted backends (a share of load, not a secret)."""


def decide(host: VirtualHost, default: Backend, *, method: str, target: str, authority: str,
           headers: Iterable[tuple[str, str]], port: int, scheme: str = "https",
           rng: random.Random | None = None) -> Forward | Reply:
    """What becomes of a request to ``host`` on the tailnet port ``port`` (spoken to in
    ``scheme``): its route's backend (by weight, with ``rng``), redirect or rewrite; the expose's
    backend (``default``) when no route matches and the host falls back to it (a host without
    routes does, unless it says it has no fallback: then it forwards nothing), else 404."""
    route = choose(host.routes, target, method, headers) if host.routes else None
    if route is None:
        if host.fallback:
            return Forward(default, target, authority)
        return Reply(404, f"no path of {host.name} matches {request_path(target)}, and it has no default backend\n")
    if route.redirect is not None:
        location = redirect_location(route.redirect, route, target, authority, port, scheme)
        return Reply(route.redirect.status, f"redirected to {location}\n", (("location", location),))
    backend = _weighted_choice(route, rng or _RNG)
    if backend is None:
        return Reply(500, f"no backend of the route {route.path} of {host.name} takes requests (every weight is 0)\n")
    rewrite = route.rewrite
    if rewrite is not None and rewrite.path is not None:
        target = replace_path(rewrite.path, route, target)
    if rewrite is not None and rewrite.hostname is not None:
        authority = rewrite.hostname
    return Forward(backend, target, authority, route.request_headers, route.response_headers)


def _weighted_choice(route: Route, rng: random.Random) -> Backend | None:
    weighted = [w for w in route.weighted if w.weight > 0]
    if not weighted:
        return None
    if len(weighted) == 1:
        return weighted[0].backend
    return rng.choices([w.backend for w in weighted], weights=[w.weight for w in weighted])[0]


def replace_path(change: PathChange, route: Route, target: str) -> str:
    """``target`` with its path changed: the whole path, or the part ``route`` (a Prefix route)
    matched, element by element (``/foo/x`` under ``/foo`` to ``/bar`` is ``/bar/x``; to ``/`` it
    is ``/x``); the query kept."""
    path, query = request_path(target), request_query(target)
    if change.type == REPLACE_FULL_PATH:
        new = change.value
    else:
        rest = path[_end_of_elements(path, len(_route_elements(route.path))):]
        new = (change.value.rstrip("/") + rest) or "/"
        if not new.startswith("/"):
            new = "/" + new
    return f"{new}?{query}" if query else new


def _end_of_elements(path: str, count: int) -> int:
    """Where the first ``count`` elements of ``path`` end (its index after them)."""
    pos = 0
    for _ in range(count):
        while pos < len(path) and path[pos] == "/":
            pos += 1
        end = path.find("/", pos)
        pos = len(path) if end < 0 else end
    return pos


WELL_KNOWN_PORTS = {"http": 80, "https": 443}


def redirect_location(redirect: Redirect, route: Route, target: str, authority: str, port: int,
                      request_scheme: str = "https") -> str:
    """The ``Location`` of a redirect: the request's scheme, host, port (the tailnet port it came
    to) and path, with what the redirect changes. A new scheme without a port takes that
    scheme's port; the port is left out where it is the scheme's own."""
    scheme = redirect.scheme or request_scheme
    hostname = redirect.hostname or host_of(authority)
    if redirect.port is not None:
        to_port = redirect.port
    elif redirect.scheme is not None:
        to_port = WELL_KNOWN_PORTS[redirect.scheme]
    else:
        to_port = port
    netloc = hostname if WELL_KNOWN_PORTS.get(scheme) == to_port else f"{hostname}:{to_port}"
    path = replace_path(redirect.path, route, target) if redirect.path is not None else target
    return f"{scheme}://{netloc}{path}"


def edit_headers(headers: Sequence[tuple[str, str]], edits: HeaderEdits) -> Headers:
    """``headers`` with ``edits`` made: each ``set`` replaces every header of its name (names
    without case), each ``add`` goes beside them, then each ``remove`` drops every one of its name."""
    if not edits:
        return list(headers)
    replaced = {m.name.lower() for m in edits.set}
    out = [(k, v) for k, v in headers if k.lower() not in replaced]
    out += [(m.name, m.value) for m in (*edits.set, *edits.add)]
    removed = {n.lower() for n in edits.remove}
    return [(k, v) for k, v in out if k.lower() not in removed]
