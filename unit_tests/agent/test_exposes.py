"""The ingress exposes file: shapes accepted, and one-line errors naming the entry."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tailnet_agent.contract.errors import ConfigError
from tailnet_agent.contract.exposes import (
    Backend,
    Expose,
    HeaderEdits,
    Match,
    PathChange,
    Redirect,
    Rewrite,
    Route,
    VirtualHost,
    WeightedBackend,
    closest,
    exposes_document,
    parse_exposes,
)
from tailnet_agent.contract.targets import PortMapping
from tailnet_agent.targets import diff_targets

TLS = {"certFile": "/tls/shop/tls.crt", "keyFile": "/tls/shop/tls.key"}


def test_tcp_and_http_exposes() -> None:
    exposes = parse_exposes(json.dumps([
        {"name": "db", "port": 5432, "backend": {"host": "db.shop.svc", "port": 5432}},
        {"name": "web", "port": 443, "mode": "http",
         "backend": {"host": "web.shop.svc", "port": 8443, "scheme": "https", "caFile": "/ca/ca.crt",
                     "serverName": "web.internal"},
         "hosts": [{"name": "Shop.Example.com.", "alias": "shop", "tls": TLS}]}]))
    db, web = exposes
    assert db == Expose(name="db", port=5432, backend=Backend(host="db.shop.svc", port=5432))
    assert db.ports == (PortMapping(port=5432, listen=5432),) and db.address == "db.shop.svc"
    assert web.mode == "http" and web.ports == (PortMapping(port=8443, listen=443),)
    assert web.backend == Backend(host="web.shop.svc", port=8443, scheme="https", ca_file="/ca/ca.crt",
                                  server_name="web.internal")
    assert web.hosts == (VirtualHost(name="shop.example.com", alias="shop", cert_file=TLS["certFile"],
                                     key_file=TLS["keyFile"]),)
    assert web.hosts[0].names == ("shop.example.com", "shop")
    assert parse_exposes('[{"name": "x", "mode": "l4", "port": 1, "backend": {"host": "h", "port": 2}}]')[0].mode \
        == "tcp"


def test_a_host_answers_to_its_further_aliases_each_once() -> None:
    [web] = parse_exposes(_one(mode="http", hosts=[
        {"name": "shop.apps.example", "alias": "shop", "aliases": ["Shop.Apps.Example.", "shop.corp.example"],
         "tls": TLS}]))
    assert web.hosts[0].names == ("shop.apps.example", "shop", "shop.corp.example")


def test_a_changed_host_changes_the_expose() -> None:
    def web(cert: str) -> tuple[Expose, ...]:
        return parse_exposes(json.dumps([{"name": "web", "port": 443, "mode": "http",
                                          "backend": {"host": "web", "port": 80},
                                          "hosts": [{"name": "a.example", "tls": {**TLS, "certFile": cert}}]}]))

    assert diff_targets(web("/a"), web("/a")).empty
    assert [e.name for e in diff_targets(web("/a"), web("/b")).changed] == ["web"]


def _http(name: str, port: int, host: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "port": port, "mode": "http", "backend": {"host": "h", "port": 80},
            "hosts": [{"name": host, "tls": TLS, **extra}]}


def test_http_exposes_may_share_a_port_and_speak_h2_to_the_backend() -> None:
    a = {**_http("a", 443, "a.example"), "backend": {"host": "grpc", "port": 50051, "protocol": "h2"}}
    doc = [a, _http("b", 443, "b.example", alias="a"), _http("c", 8443, "a.example")]
    first, second, _ = parse_exposes(json.dumps(doc))
    assert (first.port, second.port) == (443, 443)
    assert first.backend == Backend(host="grpc", port=50051, protocol="h2") and second.backend.protocol == "http1"


def test_a_hosts_routes_and_fallback_survive_the_round_trip() -> None:
    routed = VirtualHost(name="shop.example", cert_file="c", key_file="k", fallback=False, routes=(
        Route(path="/api", backend=Backend(host="api", port=8080)),
        Route(path="/api/v2", type="Exact", backend=Backend(host="v2", port=443, scheme="https", protocol="h2"))))
    plain = VirtualHost(name="plain.example", cert_file="c", key_file="k")
    web = Expose(name="web", port=443, mode="http", backend=Backend(host="web", port=80), hosts=(routed, plain))
    text = exposes_document([web])
    assert parse_exposes(text) == (web,)
    hosts = json.loads(text)[0]["hosts"]
    assert hosts[0]["routes"][0] == {"path": "/api", "type": "Prefix",
                                     "backend": {"host": "api", "port": 8080, "scheme": "http"}}
    assert hosts[0]["fallback"] is False
    assert "routes" not in hosts[1] and "fallback" not in hosts[1]  # a plain host's entry is as before


def test_an_empty_list_is_a_node_with_no_port_open() -> None:
    """A Gateway whose listeners are all TLS or TCP, none with a route yet, is a node with no port."""
    assert parse_exposes("[]") == ()


def _one(**fields: Any) -> str:
    expose = {"name": "web", "port": 443, "backend": {"host": "web", "port": 80}, **fields}
    return json.dumps([expose])


@pytest.mark.parametrize(("text", "error"), [
    ("{", "TAILNET_EXPOSES_FILE is not valid JSON: Expecting property name enclosed in double quotes at line 1 "
          "column 2"),
    ("{}", "TAILNET_EXPOSES_FILE must be a JSON list of exposes"),
    (_one(port=0), "TAILNET_EXPOSES_FILE: [0] (web).port must be a port number 1-65535, got 0"),
    (_one(mode="udp"), "TAILNET_EXPOSES_FILE: [0] (web).mode must be tcp, http or tls, got 'udp'"),
    (_one(mode="http"), "TAILNET_EXPOSES_FILE: [0] (web).hosts must be a non-empty list for mode http"),
    (_one(hosts=[{"name": "a", "tls": TLS}]), "TAILNET_EXPOSES_FILE: [0] (web): hosts go with mode http or tls"),
    (_one(mode="http", hosts=[{"name": "a"}]), "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].tls must be an object"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS}, {"name": "b", "alias": "a", "tls": TLS}]),
     "TAILNET_EXPOSES_FILE: [0] (web): a names two hosts"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS}, {"name": "b", "aliases": ["a"], "tls": TLS}]),
     "TAILNET_EXPOSES_FILE: [0] (web): a names two hosts"),
    (_one(mode="http", hosts=[{"name": "a", "aliases": "b", "tls": TLS}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].aliases must be a list of non-empty strings"),
    (_one(backend={"host": "web", "port": 80, "scheme": "https"}),
     "TAILNET_EXPOSES_FILE: [0] (web).backend.scheme must be http or https (http exposes only), got 'https'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS}], backend={"host": "w", "port": 80, "caFile": "/ca"}),
     "TAILNET_EXPOSES_FILE: [0] (web).backend: caFile and serverName go with scheme https"),
    (json.dumps([{"name": "a", "port": 1, "backend": {"host": "h", "port": 2}},
                 {"name": "b", "port": 1, "backend": {"host": "h", "port": 3}}]),
     "TAILNET_EXPOSES_FILE: port 1 is used by both a (tcp) and b (tcp); a port is shared only by exposes of one "
     "mode, http or tls"),
    (json.dumps([_http("a", 1, "x"), {"name": "b", "port": 1, "backend": {"host": "h", "port": 3}}]),
     "TAILNET_EXPOSES_FILE: port 1 is used by both a (http) and b (tcp); a port is shared only by exposes of one "
     "mode, http or tls"),
    (json.dumps([_http("a", 1, "x"), _http("b", 1, "y", alias="x")]),
     "TAILNET_EXPOSES_FILE: [1] (b): x is a host of a too, on the same port 1"),
    (_one(backend={"host": "web", "port": 80, "protocol": "h2"}),
     "TAILNET_EXPOSES_FILE: [0] (web).backend.protocol must be http1 or h2 (http exposes only), got 'h2'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS}], backend={"host": "w", "port": 80, "protocol": "h3"}),
     "TAILNET_EXPOSES_FILE: [0] (web).backend.protocol must be http1 or h2 (http exposes only), got 'h3'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "api", "backend": {"host": "h",
                                                                                               "port": 1}}]}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].routes[0].path must be a string starting with /, got 'api'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "type": "Regex",
                                                                    "backend": {"host": "h", "port": 1}}]}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].routes[0].type must be Exact or Prefix, got 'Regex'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "backend": {"host": "h"}}]}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].routes[0].backend.port must be a port number 1-65535, got None"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "fallback": "no"}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].fallback must be true or false, got 'no'"),
])
def test_errors_name_the_entry(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_exposes(text)
    assert str(info.value) == error


def test_gateway_routes_survive_the_round_trip() -> None:
    to = Backend(host="api", port=8080)
    routes = (
        Route(path="/api", method="POST", headers=(Match(name="X-Env", value="canary"),),
              query=(Match(name="v", value="2"),),
              backends=(WeightedBackend(backend=to, weight=3), WeightedBackend(backend=Backend(host="b", port=1),
                                                                                weight=0)),
              request_headers=HeaderEdits(set=(Match(name="X-A", value="1"),), remove=("X-B",)),
              response_headers=HeaderEdits(add=(Match(name="X-C", value="2"),)),
              rewrite=Rewrite(hostname="inside.svc", path=PathChange(type="ReplacePrefixMatch", value="/"))),
        Route(path="/old", type="Exact", redirect=Redirect(scheme="http", hostname="new.example", port=8080,
                                                           path=PathChange(type="ReplaceFullPath", value="/new"),
                                                           status=301)),
    )
    host = VirtualHost(name="gw.example", cert_file="c", key_file="k", routes=routes)
    web = Expose(name="gw", port=443, mode="http", backend=Backend(host="web", port=80), hosts=(host,))
    assert parse_exposes(exposes_document([web])) == (web,)


def _route(**fields: Any) -> str:
    route = {"path": "/", "backend": {"host": "h", "port": 1}, **fields}
    return _one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [route]}])


ROUTE = "TAILNET_EXPOSES_FILE: [0] (web).hosts[0].routes[0]"


@pytest.mark.parametrize(("text", "error"), [
    (_route(backends=[]), f"{ROUTE} needs exactly one of backend, backends and redirect, got backend, backends"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/"}]}]),
     f"{ROUTE} needs exactly one of backend, backends and redirect, got none"),
    (_route(method="get"), f"{ROUTE}.method must be one of GET, HEAD, POST, PUT, DELETE, CONNECT, OPTIONS, TRACE, "
                           "PATCH, got 'get'"),
    (_route(headers=[{"name": "x", "value": "a.*", "type": "RegularExpression"}]),
     f"{ROUTE}.headers[0].type must be Exact (regular expressions are not supported), got 'RegularExpression'"),
    (_route(headers=[{"name": "X-A", "value": "1"}, {"name": "x-a", "value": "2"}]),
     f"{ROUTE}.headers names a header twice"),
    (_route(query=[{"name": "v"}]), f"{ROUTE}.query[0].value must be a string"),
    (_route(requestHeaders={"set": [{"name": "Tailnet-User-Login", "value": "mallory"}]}),
     f"{ROUTE}.requestHeaders.set[0].name: Tailnet-User-Login is the agent's to write (hop-by-hop, forwarding, "
     "Host or the caller's identity), never a route's"),
    (_route(requestHeaders={"remove": ["tailscale_user_login"]}),
     f"{ROUTE}.requestHeaders.remove[0]: tailscale_user_login is the agent's to write (hop-by-hop, forwarding, "
     "Host or the caller's identity), never a route's"),
    (_route(responseHeaders={"add": [{"name": "Transfer-Encoding", "value": "chunked"}]}),
     f"{ROUTE}.responseHeaders.add[0].name: Transfer-Encoding is the agent's to write (hop-by-hop, forwarding, "
     "Host or the caller's identity), never a route's"),
    (_route(requestHeaders={"set": [{"name": "Bad Name", "value": "1"}]}),
     f"{ROUTE}.requestHeaders.set[0].name must be a header name, got 'Bad Name'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "backends": [
        {"backend": {"host": "h", "port": 1}, "weight": -1}]}]}]),
     f"{ROUTE}.backends[0].weight must be a whole number 0-1000000, got -1"),
    (_route(type="Exact", rewrite={"path": {"type": "ReplacePrefixMatch", "value": "/"}}),
     f"{ROUTE}.rewrite.path: ReplacePrefixMatch goes with a Prefix route only"),
    (_route(rewrite={"path": {"type": "ReplaceFullPath", "value": "x"}}),
     f"{ROUTE}.rewrite.path.value must be a path starting with /, got 'x'"),
    (_route(rewrite={"hostname": "a/b"}), f"{ROUTE}.rewrite.hostname must be a host name, got 'a/b'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "redirect": {"statusCode": 200}}]}]),
     f"{ROUTE}.redirect.statusCode must be one of (301, 302, 303, 307, 308), got 200"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "redirect": {"scheme": "ftp"}}]}]),
     f"{ROUTE}.redirect.scheme must be http or https, got 'ftp'"),
    (_one(mode="http", hosts=[{"name": "a", "tls": TLS, "routes": [{"path": "/", "redirect": {},
                                                                    "rewrite": {"hostname": "b"}}]}]),
     f"{ROUTE}: a redirect goes to no backend, so it takes no rewrite or requestHeaders"),
])
def test_a_bad_gateway_route_is_refused_by_name(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_exposes(text)
    assert str(info.value) == error


def test_a_plaintext_expose_has_hosts_without_tls_and_may_answer_any_host() -> None:
    web = Expose(name="web", port=80, mode="http", plaintext=True, backend=Backend(host="web", port=8080),
                 hosts=(VirtualHost(name="shop.example"), VirtualHost(name="*")))
    text = exposes_document([web])
    assert parse_exposes(text) == (web,)
    entry = json.loads(text)[0]
    assert entry["plaintext"] is True and all("tls" not in h for h in entry["hosts"])


@pytest.mark.parametrize(("text", "error"), [
    (_one(mode="http", plaintext=True, hosts=[{"name": "a", "tls": TLS}]),
     "TAILNET_EXPOSES_FILE: [0] (web).hosts[0]: a plaintext expose's host takes no tls"),
    (_one(plaintext=True), "TAILNET_EXPOSES_FILE: [0] (web).plaintext must be true or false, and goes with mode http"),
    (json.dumps([_http("a", 1, "x"), {"name": "b", "port": 1, "mode": "http", "plaintext": True,
                                      "backend": {"host": "h", "port": 3}, "hosts": [{"name": "y"}]}]),
     "TAILNET_EXPOSES_FILE: port 1 is used by both a and b, one with TLS and one without; the exposes of one port "
     "are all plaintext or all TLS"),
])
def test_a_plaintext_expose_is_refused_by_name(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_exposes(text)
    assert str(info.value) == error


def test_the_closest_host_answers_an_exact_name_then_the_longest_wildcard_then_any() -> None:
    hosts = [("any", VirtualHost(name="*")), ("wide", VirtualHost(name="*.example.test")),
             ("narrow", VirtualHost(name="*.shop.example.test")),
             ("exact", VirtualHost(name="shop.example.test", aliases=("alias.example.test",)))]
    picked = {name: (found[0] if (found := closest(hosts, name)) else None)
              for name in ("shop.example.test", "alias.example.test", "a.shop.example.test",
                           "a.b.shop.example.test", "other.example.test", "example.test", "elsewhere.test")}
    assert picked == {"shop.example.test": "exact", "alias.example.test": "exact", "a.shop.example.test": "narrow",
                      "a.b.shop.example.test": "narrow", "other.example.test": "wide", "example.test": "any",
                      "elsewhere.test": "any"}
    assert closest(hosts[1:2], "example.test") is None, "a wildcard covers one or more labels, not its suffix"
    assert closest(hosts[1:3] + hosts[1:2], "x.example.test") == hosts[1], "the first of equals"


def test_a_tls_expose_may_have_wildcard_and_any_hosts() -> None:
    web = Expose(name="web", port=443, mode="http", backend=Backend(host="web", port=8080),
                 hosts=(VirtualHost(name="*.example.test", cert_file="w.crt", key_file="w.key"),
                        VirtualHost(name="*", cert_file="a.crt", key_file="a.key", fallback=False)))
    assert parse_exposes(exposes_document([web])) == (web,)


def _tls(name: str, port: int, *hosts: str) -> dict[str, Any]:
    return {"name": name, "port": port, "mode": "tls", "backend": {"host": f"{name}.shop.svc", "port": 8443},
            "hosts": [{"name": h} for h in hosts]}


def test_tls_exposes_share_a_port_and_carry_names_only() -> None:
    text = json.dumps([_tls("db", 443, "db.example.test", "*.db.example.test"), _tls("any", 443, "*"),
                       {**_tls("mq", 5671, "mq.example.test"),
                        "hosts": [{"name": "MQ.Example.Test.", "alias": "mq", "aliases": ["mq.corp.test"]}]}])
    db, anyhost, mq = parse_exposes(text)
    assert db == Expose(name="db", port=443, mode="tls", backend=Backend(host="db.shop.svc", port=8443),
                        hosts=(VirtualHost(name="db.example.test"), VirtualHost(name="*.db.example.test")))
    assert anyhost.hosts == (VirtualHost(name="*"),) and mq.hosts[0].names == ("mq.example.test", "mq", "mq.corp.test")
    assert parse_exposes(exposes_document([db, anyhost, mq])) == (db, anyhost, mq)
    entry = json.loads(exposes_document([db]))[0]
    assert entry == {"name": "db", "port": 443, "mode": "tls", "backend": {"host": "db.shop.svc", "port": 8443},
                     "hosts": [{"name": "db.example.test"}, {"name": "*.db.example.test"}]}


@pytest.mark.parametrize(("text", "error"), [
    (json.dumps([{**_tls("db", 443, "a"), "hosts": []}]),
     "TAILNET_EXPOSES_FILE: [0] (db).hosts must be a non-empty list for mode tls"),
    (json.dumps([{**_tls("db", 443, "a"), "hosts": [{"name": "a", "tls": TLS}]}]),
     "TAILNET_EXPOSES_FILE: [0] (db).hosts[0]: a tls expose's host is names only, it takes no tls"),
    (json.dumps([{**_tls("db", 443, "a"), "hosts": [{"name": "a", "routes": [], "fallback": False}]}]),
     "TAILNET_EXPOSES_FILE: [0] (db).hosts[0]: a tls expose's host is names only, it takes no routes, fallback"),
    (json.dumps([{**_tls("db", 443, "a"), "plaintext": True}]),
     "TAILNET_EXPOSES_FILE: [0] (db).plaintext must be true or false, and goes with mode http"),
    (json.dumps([{**_tls("db", 443, "a"), "backend": {"host": "h", "port": 1, "scheme": "https"}}]),
     "TAILNET_EXPOSES_FILE: [0] (db).backend.scheme must be http or https (http exposes only), got 'https'"),
    (json.dumps([{**_tls("db", 443, "a"), "backend": {"host": "h", "port": 1, "protocol": "h2"}}]),
     "TAILNET_EXPOSES_FILE: [0] (db).backend.protocol must be http1 or h2 (http exposes only), got 'h2'"),
    (json.dumps([_tls("db", 443, "a"), _http("web", 443, "b")]),
     "TAILNET_EXPOSES_FILE: port 443 is used by both db (tls) and web (http); a port is shared only by exposes of "
     "one mode, http or tls"),
    (json.dumps([_tls("db", 443, "a"), {"name": "raw", "port": 443, "backend": {"host": "h", "port": 1}}]),
     "TAILNET_EXPOSES_FILE: port 443 is used by both db (tls) and raw (tcp); a port is shared only by exposes of "
     "one mode, http or tls"),
    (json.dumps([_tls("db", 443, "a", "*"), _tls("mq", 443, "b", "*")]),
     "TAILNET_EXPOSES_FILE: [1] (mq): * is a host of db too, on the same port 443"),
])
def test_a_bad_tls_expose_is_refused_by_name(text: str, error: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_exposes(text)
    assert str(info.value) == error
