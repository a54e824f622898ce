"""A Gateway of the tailnet GatewayClass and its HTTPRoutes as the TailnetIngress they are served as
(:mod:`tailnet_operator.resources.gatewayapi`): listeners, attachment, hostnames, rules, and what
the statuses say."""

from __future__ import annotations

import base64
import datetime
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.resources import gatewayapi as gw
from tailnet_operator.resources import ingress as build

NS = "shop"


def gateway(*listeners: dict[str, Any]) -> gw.GatewayObject:
    return gw.GatewayObject.model_validate({
        "metadata": {"name": "edge", "namespace": NS, "uid": "g-1"},
        "spec": {"gatewayClassName": "tailnet", "listeners": list(listeners)}})


def https(name: str, hostname: str | None = None, *, port: int = 443, secret: str = "edge-tls",
          **more: Any) -> dict[str, Any]:
    listener: dict[str, Any] = {"name": name, "port": port, "protocol": "HTTPS",
                                "tls": {"mode": "Terminate", "certificateRefs": [{"kind": "Secret", "name": secret}]},
                                **more}
    if hostname:
        listener["hostname"] = hostname
    return listener


def route(name: str, *rules: dict[str, Any], hostnames: tuple[str, ...] = (), namespace: str = NS,
          parents: tuple[dict[str, Any], ...] = ({"name": "edge"},), created: str = "2026-01-01T00:00:00Z"
          ) -> gw.RouteObject:
    return gw.RouteObject.model_validate({
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {"parentRefs": list(parents), "hostnames": list(hostnames),
                 "rules": list(rules) or [{"backendRefs": [{"name": "web", "port": 80}]}]}})


def plan(g: gw.GatewayObject, *routes: gw.RouteObject, services: frozenset[str] = frozenset({"web", "api",
                                                                                                  "canary"}),
         labels: dict[str, dict[str, str]] | None = None, tenants: frozenset[str] = frozenset(),
         grants: tuple[dict[str, Any], ...] = ()) -> gw.GatewayPlan:
    return gw.as_ingress(g, routes, "corp", tag="tag:edge", hostname="edge",
                         services=lambda ns, name: ({"spec": {}} if name in services else None),
                         certificates=lambda ns, name: None if name == "edge-tls" else "not found",
                         labels=lambda ns: (labels or {}).get(ns), shares=lambda ns: ns in tenants,
                         granted=lambda *ref: gw.reference_granted(grants, *ref))


def agent_hosts(result: gw.GatewayPlan) -> dict[str, Any]:
    assert result.ingress is not None, result.accepted
    exposes = parse_exposes(build.exposes_document(result.ingress, []))
    return {h.name: h for e in exposes for h in e.hosts}


def test_the_class_names_its_tailnet_by_parameters_ref() -> None:
    good = {"spec": {"controllerName": gw.CONTROLLER, "parametersRef": {"group": "tailnet.dev", "kind": "Tailnet",
                                                                         "name": "corp"}}}
    assert gw.tailnet_of_class(good) == "corp"
    assert gw.tailnet_of_class({"spec": {**good["spec"], "controllerName": "example.com/other"}}) is None
    assert gw.tailnet_of_class({"spec": {"controllerName": gw.CONTROLLER}}) is None
    assert gw.tailnet_of_class(None) is None


def test_an_https_listener_serves_its_routes_rules_as_paths_with_matches_weights_and_filters() -> None:
    rules = [
        {"matches": [{"path": {"type": "PathPrefix", "value": "/api"}, "headers": [{"name": "X-Env", "value": "c"}]},
                     {"path": {"type": "PathPrefix", "value": "/v2"}, "method": "POST",
                      "queryParams": [{"name": "v", "value": "2"}]}],
         "filters": [{"type": "RequestHeaderModifier",
                      "requestHeaderModifier": {"set": [{"name": "X-A", "value": "1"}]}},
                     {"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch",
                                                                     "replacePrefixMatch": "/"}}}],
         "backendRefs": [{"name": "api", "port": 8080, "weight": 90}, {"name": "canary", "port": 8080, "weight": 10}]},
        {"matches": [{"path": {"type": "PathPrefix", "value": "/old"}}],
         "filters": [{"type": "RequestRedirect", "requestRedirect": {"scheme": "https", "statusCode": 301,
                                                                      "path": {"type": "ReplaceFullPath",
                                                                               "replaceFullPath": "/new"}}}]},
    ]
    result = plan(gateway(https("web", "shop.example.test")), route("r", *rules))
    [host] = agent_hosts(result).values()
    api, v2, old = host.routes
    assert (api.path, api.type, api.headers[0].name) == ("/api", "Prefix", "X-Env")
    assert [(w.backend.host, w.weight) for w in api.backends] == [("api.shop.svc", 90), ("canary.shop.svc", 10)]
    assert api.rewrite is not None and api.rewrite.path is not None and api.rewrite.path.value == "/"
    assert api.request_headers.set[0].name == "X-A"
    assert (v2.type, v2.method, v2.query[0].value) == ("Prefix", "POST", "2")
    assert old.redirect is not None and (old.redirect.status, old.redirect.scheme) == (301, "https")
    assert not host.fallback, "a request no path matches gets 404"
    assert result.listeners[0].attached_routes == 1
    [parent] = result.parents[("HTTPRoute", NS, "r")]
    assert parent.accepted.status and parent.resolved_refs.status
    assert parent.parent == {"group": gw.GROUP, "kind": "Gateway", "namespace": NS, "name": "edge"}


def test_a_wildcard_listener_serves_its_routes_hostnames_where_they_intersect() -> None:
    result = plan(gateway(https("web", "*.example.test")),
                  route("a", hostnames=("a.example.test", "*.example.test")), route("b", hostnames=("b.example.test",)),
                  route("narrow", hostnames=("*.n.example.test", "*.test")),
                  route("other", hostnames=("x.elsewhere.test",)))
    hosts = agent_hosts(result)
    assert sorted(hosts) == ["*.example.test", "*.n.example.test", "a.example.test", "b.example.test"]
    # The route *.test intersects the listener as the listener's own *.example.test.
    assert [len(hosts[name].routes) for name in sorted(hosts)] == [2, 1, 1, 1]
    other = result.parents[("HTTPRoute", NS, "other")][0].accepted
    assert (other.status, other.reason) == (False, "NoMatchingListenerHostname")


def test_routes_are_ordered_oldest_first_then_by_namespace_and_name() -> None:
    young = route("a-young", {"matches": [{"path": {"value": "/"}}], "backendRefs": [{"name": "canary", "port": 1}]},
                  hostnames=("s.example.test",), created="2026-02-01T00:00:00Z")
    old = route("z-old", {"matches": [{"path": {"value": "/"}}], "backendRefs": [{"name": "web", "port": 1}]},
                hostnames=("s.example.test",), created="2026-01-01T00:00:00Z")
    host = agent_hosts(plan(gateway(https("web")), young, old))["s.example.test"]
    assert [r.backend.host for r in host.routes if r.backend] == ["web.shop.svc", "canary.shop.svc"]


def test_attachment_follows_section_name_port_and_allowed_routes() -> None:
    g = gateway(https("same", "a.example.test"),
                https("all", "b.example.test", port=8443, allowedRoutes={"namespaces": {"from": "All"}}),
                https("picked", "c.example.test", port=9443, allowedRoutes={"namespaces": {
                    "from": "Selector", "selector": {"matchLabels": {"team": "shop"}}}}))
    here = route("here", parents=({"name": "edge", "sectionName": "same"},))
    away = route("away", namespace="web", parents=({"name": "edge", "namespace": NS},))
    picked = route("picked", namespace="team", parents=({"name": "edge", "namespace": NS, "port": 9443},))
    missing = route("missing", parents=({"name": "edge", "sectionName": "nope"},))
    result = plan(g, here, away, picked, missing, services=frozenset({"web"}), labels={"team": {"team": "shop"}})
    hosts = agent_hosts(result)
    assert [name for name, h in sorted(hosts.items()) if h.routes] == ["a.example.test"]
    assert sorted(hosts) == ["a.example.test", "b.example.test", "c.example.test"]  # b, c: 404 until routed
    # Attached as the specification counts (allowedRoutes, parentRefs), though not served.
    assert {ls.name: ls.attached_routes for ls in result.listeners} == {"same": 1, "all": 1, "picked": 1}
    assert result.parents[("HTTPRoute", NS, "missing")][0].accepted.reason == "NoMatchingParent"
    # Admitted by allowedRoutes, but not served: their namespaces may not use the Gateway's tag.
    for key in (("HTTPRoute", "web", "away"), ("HTTPRoute", "team", "picked")):
        [parent] = result.parents[key]
        assert (parent.accepted.status, parent.accepted.reason) == (False, "NotAllowedByListeners")
        assert f"namespace {key[1]} may not use the tag of the Gateway's node" in parent.accepted.message
    # Once the tenancy lets them, they are served, each to the Services of its own namespace.
    shared = plan(g, here, away, picked, services=frozenset({"web"}), labels={"team": {"team": "shop"}},
                  tenants=frozenset({"web", "team"}))
    routed = {name: [r.backend.host for r in h.routes if r.backend] for name, h in agent_hosts(shared).items()}
    assert routed == {"a.example.test": ["web.shop.svc"], "b.example.test": ["web.web.svc"],
                      "c.example.test": ["web.team.svc"]}
    stranger = plan(g, route("stranger", namespace="other", parents=({"name": "edge", "namespace": NS,
                                                                      "sectionName": "same"},)))
    assert stranger.parents[("HTTPRoute", "other", "stranger")][0].accepted.reason == "NotAllowedByListeners"
    assert all(not h.routes and not h.fallback for h in agent_hosts(stranger).values())  # nothing reaches a backend


def test_an_http_listener_is_served_as_a_plaintext_expose() -> None:
    result = plan(gateway({"name": "plain", "port": 80, "protocol": "HTTP", "hostname": "s.example.test"},
                          https("tls", "t.example.test")), route("r"))
    assert result.ingress is not None
    exposes = {e.port: e for e in parse_exposes(build.exposes_document(result.ingress, []))}
    assert exposes[80].plaintext and exposes[80].hosts[0].name == "s.example.test"
    assert exposes[80].hosts[0].cert_file == "" and not exposes[443].plaintext
    assert {ls.name: ls.attached_routes for ls in result.listeners} == {"plain": 1, "tls": 1}


def test_a_gateway_without_routes_listens_on_each_served_port_and_answers_404() -> None:
    """So that it is Programmed with an address before its first route, as users and the
    conformance suite expect."""
    result = plan(gateway({"name": "plain", "port": 80, "protocol": "HTTP"}, https("tls", "t.example.test"),
                          https("broken", "b.example.test", port=8443, secret="missing")))
    assert result.accepted.status and result.ingress is not None
    exposes = {e.port: e for e in parse_exposes(build.exposes_document(result.ingress, []))}
    assert sorted(exposes) == [80, 443]  # the listener whose Secret is missing is not served
    assert [(h.name, h.routes, h.fallback) for h in exposes[80].hosts] == [("*", (), False)]
    assert [(h.name, h.routes, h.fallback) for h in exposes[443].hosts] == [("t.example.test", (), False)]
    assert exposes[443].hosts[0].cert_file


def test_an_http_listener_without_a_hostname_serves_a_route_without_hostnames_for_any_host() -> None:
    """The Gateway API's "no hostname on either side matches any": the agent's host ``*``, which
    answers every name no other host of the port answers to, over TLS with the listener's certificate."""
    result = plan(gateway({"name": "plain", "port": 80, "protocol": "HTTP"}, https("tls", port=8443)),
                  route("anyhost"), route("named", hostnames=("a.example.test",)))
    exposes = {e.port: e for e in parse_exposes(build.exposes_document(result.ingress or _no(result), []))}
    hosts = {h.name: h for h in exposes[80].hosts}
    assert sorted(hosts) == ["*", "a.example.test"] and hosts["*"].routes and hosts["a.example.test"].routes
    tls = {h.name: h for h in exposes[8443].hosts}
    assert sorted(tls) == ["*", "a.example.test"] and tls["*"].routes and tls["*"].cert_file


def _no(result: gw.GatewayPlan) -> Any:
    raise AssertionError(result.accepted)


def test_listeners_of_one_port_with_two_protocols_are_both_refused() -> None:
    result = plan(gateway({"name": "plain", "port": 443, "protocol": "HTTP"}, https("tls", "t.example.test")),
                  route("r"))
    assert result.ingress is None
    assert (result.accepted.status, result.accepted.reason) == (False, "ListenersNotValid")
    for listener in result.listeners:
        accepted = next(c for c in listener.conditions if c.type == "Accepted")
        assert (accepted.status, accepted.reason) == (False, "ProtocolConflict"), listener


@pytest.mark.parametrize(("listener", "condition", "reason"), [
    ({"name": "raw", "port": 5432, "protocol": "UDP"}, "Accepted", "UnsupportedProtocol"),
    (https("pass", tls={"mode": "Passthrough"}), "Accepted", "UnsupportedValue"),
    (https("nocert", secret="missing"), "ResolvedRefs", "InvalidCertificateRef"),
    (https("far", tls={"certificateRefs": [{"name": "edge-tls", "namespace": "vault"}]}), "ResolvedRefs",
     "RefNotPermitted"),
])
def test_a_listener_that_cannot_be_served_says_why_and_serves_nothing(listener: dict[str, Any], condition: str,
                                                                       reason: str) -> None:
    result = plan(gateway(listener, https("good", "ok.example.test")), route("r"))
    bad = next(ls for ls in result.listeners if ls.name == listener["name"])
    failed = next(c for c in bad.conditions if c.type == condition)
    assert (failed.status, failed.reason) == (False, reason) and failed.message
    assert sorted(agent_hosts(result)) == ["ok.example.test"]
    # The route still counts as attached to it: the specification counts by allowedRoutes and
    # parentRefs alone, whatever the listener's or the route's conditions (a UDP listener takes
    # UDPRoutes, so not an HTTPRoute).
    assert bad.attached_routes == (0 if listener["protocol"] == "UDP" else 1)


def test_backends_that_do_not_resolve_say_so_and_take_no_requests() -> None:
    rules: list[dict[str, Any]] = [
             {"backendRefs": [{"name": "web", "port": 80}, {"name": "gone", "port": 80}]},
             {"matches": [{"path": {"value": "/far"}}], "backendRefs": [{"name": "web", "namespace": "x", "port": 80}]},
             {"matches": [{"path": {"value": "/none"}}]}]
    result = plan(gateway(https("web", "s.example.test")), route("r", *rules))
    resolved = result.parents[("HTTPRoute", NS, "r")][0].resolved_refs
    assert (resolved.status, resolved.reason) == (False, "BackendNotFound")
    [host] = agent_hosts(result).values()
    root, far, none = host.routes
    assert [(w.backend.host, w.weight) for w in root.backends] == [("web.shop.svc", 1), ("gone.shop.svc", 0)]
    assert [w.weight for w in far.backends] == [0] and [w.weight for w in none.backends] == [0]


@pytest.mark.parametrize(("rule", "text"), [
    ({"matches": [{"path": {"type": "RegularExpression", "value": "/a.*"}}]}, "RegularExpression paths"),
    ({"matches": [{"headers": [{"type": "RegularExpression", "name": "x", "value": "a.*"}]}]}, "only Exact matches"),
    ({"filters": [{"type": "RequestMirror", "requestMirror": {}}]}, "the filter RequestMirror is not served"),
    ({"matches": [{"path": {"type": "Exact", "value": "/a"}}], "filters": [
        {"type": "URLRewrite", "urlRewrite": {"path": {"type": "ReplacePrefixMatch", "replacePrefixMatch": "/"}}}]},
     "ReplacePrefixMatch goes with pathType Prefix only"),
    ({"filters": [{"type": "RequestHeaderModifier", "requestHeaderModifier": {
        "set": [{"name": "Tailnet-User-Login", "value": "mallory"}]}}]}, "Tailnet-User-Login is the agent's to write"),
])
def test_what_the_node_cannot_serve_refuses_the_route_not_the_gateway(rule: dict[str, Any], text: str) -> None:
    result = plan(gateway(https("web", "s.example.test")), route("bad", {**rule, "backendRefs": [
        {"name": "web", "port": 80}]}), route("good"))
    accepted = result.parents[("HTTPRoute", NS, "bad")][0].accepted
    assert (accepted.status, accepted.reason) == (False, "UnsupportedValue") and text in accepted.message
    assert result.parents[("HTTPRoute", NS, "good")][0].accepted.status and result.ingress is not None


def test_hostnames_intersect_as_the_specification_says() -> None:
    assert gw.hostnames_intersect(None, ["a.example.test"]) and gw.hostnames_intersect("a.example.test", [])
    assert gw.hostnames_intersect("*.example.test", ["a.example.test"])
    assert gw.hostnames_intersect("a.b.example.test", ["*.example.test"])
    assert not gw.hostnames_intersect("*.example.test", ["example.test"])
    assert not gw.hostnames_intersect("a.example.test", ["b.example.test"])


NOW, LATER = "2026-12-03T10:00:00Z", "2026-12-03T11:00:00Z"


def test_the_gateway_status_says_accepted_programmed_listeners_and_addresses() -> None:
    g = gateway(https("web", "s.example.test"), {"name": "raw", "port": 5432, "protocol": "UDP"})
    result = plan(g, route("r"))
    node = {"name": "edge.tail.example.", "addresses": ["100.64.0.7", "fd7a:115c:a1e0::7"]}
    status = gw.gateway_status(result, g, node, ready=True, current=None, now=NOW)
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Accepted": ("True", "ListenersNotValid"), "Programmed": ("True", "Programmed")}  # served without raw
    assert status["addresses"] == [{"type": "IPAddress", "value": "100.64.0.7"},
                                   {"type": "IPAddress", "value": "fd7a:115c:a1e0::7"},
                                   {"type": "Hostname", "value": "edge.tail.example"}]
    web, raw = status["listeners"]
    assert web["attachedRoutes"] == 1 and web["supportedKinds"] == [{"group": gw.GROUP, "kind": "HTTPRoute"},
                                                                  {"group": gw.GROUP, "kind": "GRPCRoute"}]
    assert {c["type"]: c["status"] for c in web["conditions"]} == {"Accepted": "True", "ResolvedRefs": "True",
                                                                   "Programmed": "True"}
    assert {c["type"]: c["reason"] for c in raw["conditions"]}["Accepted"] == "UnsupportedProtocol"
    assert raw["supportedKinds"] == []
    assert {c["type"]: c["status"] for c in raw["conditions"]}["Programmed"] == "False"

    pending = gw.gateway_status(result, g, None, ready=False, current=status, now=LATER)
    programmed = next(c for c in pending["conditions"] if c["type"] == "Programmed")
    accepted = next(c for c in pending["conditions"] if c["type"] == "Accepted")
    assert (programmed["status"], programmed["lastTransitionTime"]) == ("False", LATER)
    assert accepted["lastTransitionTime"] == NOW, "an unchanged condition keeps its transition time"
    assert "addresses" not in pending


def test_a_routes_parents_keep_other_controllers_entries_and_replace_ours() -> None:
    result = plan(gateway(https("web", "s.example.test")), route("r"))
    [ours] = result.parents[("HTTPRoute", NS, "r")]
    other = {"parentRef": {"group": gw.GROUP, "kind": "Gateway", "namespace": NS, "name": "edge"},
             "controllerName": "example.com/other", "conditions": []}
    stale = {"parentRef": ours.parent, "controllerName": gw.CONTROLLER,
             "conditions": [{"type": "Accepted", "status": "True", "lastTransitionTime": NOW}]}
    stored = {"metadata": {"generation": 3}, "status": {"parents": [other, stale]}}
    parents = gw.route_parents(stored, [ours], now=LATER)
    assert parents[0] == other and len(parents) == 2
    mine = parents[1]
    assert mine["controllerName"] == gw.CONTROLLER and mine["parentRef"] == ours.parent
    accepted = next(c for c in mine["conditions"] if c["type"] == "Accepted")
    assert accepted["lastTransitionTime"] == NOW and accepted["observedGeneration"] == 3


def _grant(namespace: str, *, from_namespace: str = NS, kind: str = "HTTPRoute", to_kind: str = "Service",
           name: str | None = None) -> dict[str, Any]:
    to = {"group": "", "kind": to_kind, **({"name": name} if name else {})}
    return {"metadata": {"name": "g", "namespace": namespace},
            "spec": {"from": [{"group": gw.GROUP, "kind": kind, "namespace": from_namespace}], "to": [to]}}


def test_a_backend_of_another_namespace_is_served_only_under_its_reference_grant() -> None:
    rule = {"backendRefs": [{"name": "db-api", "namespace": "data", "port": 80}]}
    g = gateway(https("web", "a.example.test"))
    refused = plan(g, route("r", rule), services=frozenset({"db-api"}))
    [parent] = refused.parents[("HTTPRoute", NS, "r")]
    assert (parent.resolved_refs.status, parent.resolved_refs.reason) == (False, "RefNotPermitted")
    # A grant of another kind, of another namespace or for another Service permits nothing.
    for wrong in (_grant("data", kind="Gateway"), _grant("data", from_namespace="web"), _grant("other"),
                  _grant("data", name="other-api"), _grant("data", to_kind="Secret")):
        refused = plan(g, route("r", rule), services=frozenset({"db-api"}), grants=(wrong,))
        [parent] = refused.parents[("HTTPRoute", NS, "r")]
        assert parent.resolved_refs.reason == "RefNotPermitted", wrong
    for grant in (_grant("data"), _grant("data", name="db-api")):
        served = plan(g, route("r", rule), services=frozenset({"db-api"}), grants=(grant,))
        [parent] = served.parents[("HTTPRoute", NS, "r")]
        assert parent.resolved_refs.status, parent.resolved_refs
        [host] = agent_hosts(served).values()
        assert [r.backend.host for r in host.routes if r.backend] == ["db-api.data.svc"]


def test_a_certificate_of_another_namespace_is_served_as_a_copy_under_its_reference_grant() -> None:
    listener = https("web", "a.example.test")
    listener["tls"]["certificateRefs"][0]["namespace"] = "certs"
    no_grant = plan(gateway(listener))
    [condition] = [c for c in no_grant.listeners[0].conditions if c.type == "ResolvedRefs"]
    assert (condition.status, condition.reason) == (False, "RefNotPermitted")
    assert no_grant.ingress is None
    granted = plan(gateway(listener), grants=(_grant("certs", kind="Gateway", to_kind="Secret"),))
    [condition] = [c for c in granted.listeners[0].conditions if c.type == "ResolvedRefs"]
    assert condition.status, condition
    copy = gw.certificate_copy_name("edge", "certs", "edge-tls")
    assert [h.cert_file.split("/")[-2] for h in agent_hosts(granted).values()] == [copy]
    assert copy.startswith("edge-gw-cert-") and copy != gw.certificate_copy_name("edge", "other", "edge-tls")


def test_a_listener_naming_a_route_kind_not_served_says_so_and_lists_the_kinds_it_takes() -> None:
    only = {"name": "only", "port": 80, "protocol": "HTTP", "allowedRoutes": {"kinds": [{"kind": "InvalidRoute"}]}}
    mixed = {"name": "mixed", "port": 81, "protocol": "HTTP",
             "allowedRoutes": {"kinds": [{"kind": "InvalidRoute"}, {"kind": "HTTPRoute"}]}}
    fine = {"name": "fine", "port": 82, "protocol": "HTTP"}
    result = plan(gateway(only, mixed, fine))
    status = gw.gateway_status(result, gateway(only, mixed, fine), None, ready=False, current=None, now=NOW)
    found = {ls["name"]: ls for ls in status["listeners"]}
    assert [found[n]["supportedKinds"] for n in ("only", "mixed", "fine")] == [
        [], [{"group": gw.GROUP, "kind": "HTTPRoute"}],
        [{"group": gw.GROUP, "kind": "HTTPRoute"}, {"group": gw.GROUP, "kind": "GRPCRoute"}]]
    for name in ("only", "mixed"):
        resolved = next(c for c in found[name]["conditions"] if c["type"] == "ResolvedRefs")
        assert (resolved["status"], resolved["reason"]) == ("False", "InvalidRouteKinds")
        assert "InvalidRoute" in resolved["message"]
    assert (result.accepted.status, result.accepted.reason) == (True, "ListenersNotValid")


def test_a_route_on_a_listener_waiting_for_its_certificate_is_counted_and_its_backends_resolved() -> None:
    waiting = https("tls", secret="missing-tls")
    result = plan(gateway(waiting), route("r", {"backendRefs": [{"name": "does-not-exist", "port": 8080}]}))
    assert result.ingress is None
    [listener] = result.listeners
    assert listener.attached_routes == 1
    assert {c.type: (c.status, c.reason) for c in listener.conditions}["ResolvedRefs"] == (
        False, "InvalidCertificateRef")
    [parent] = result.parents[("HTTPRoute", NS, "r")]
    assert (parent.resolved_refs.status, parent.resolved_refs.reason) == (False, "BackendNotFound")


def tls_data(name: str = "edge.example.test", *, key_of: ec.EllipticCurvePrivateKey | None = None) -> dict[str, str]:
    """A kubernetes.io/tls Secret's data: a self-signed certificate for ``name`` and a key (its own,
    or ``key_of``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    pem_key = (key_of or key).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption())
    return {"tls.crt": base64.b64encode(cert.public_bytes(serialization.Encoding.PEM)).decode(),
            "tls.key": base64.b64encode(pem_key).decode()}


def test_a_certificate_secret_must_hold_a_pem_certificate_and_its_key() -> None:
    hello = base64.b64encode(b"Hello world\n").decode()  # the conformance suite's malformed Secret
    cases: dict[str, tuple[dict[str, Any] | None, str | None]] = {
        "good": ({"data": tls_data()}, None),
        "absent": (None, "not found"),
        "empty": ({"data": {}}, "no tls.crt and tls.key"),
        "malformed": ({"data": {"tls.crt": hello, "tls.key": hello}}, "tls.crt is not a PEM certificate"),
        "bad key": ({"data": {**tls_data(), "tls.key": hello}}, "tls.key is not an unencrypted PEM private key"),
        "other key": ({"data": tls_data(key_of=ec.generate_private_key(ec.SECP256R1()))},
                      "tls.key is not the key of the certificate in tls.crt"),
        "not base64": ({"data": {"tls.crt": "%%%", "tls.key": "%%%"}}, "not base64"),
    }
    for case, (secret, expected) in cases.items():
        found = gw.certificate_problem(secret)
        assert (found is None) if expected is None else (found is not None and expected in found), (case, found)


def test_a_headless_service_is_dialled_on_its_target_port() -> None:
    """Its name resolves to the endpoints, which listen on the targetPort (HTTPRouteServiceTypes)."""
    headless = {"spec": {"clusterIP": "None", "ports": [{"port": 8080, "targetPort": 3000},
                                                        {"port": 8081, "targetPort": "named"}, {"port": 9090}]}}
    assert [gw.dial_port(headless, p) for p in (8080, 9090)] == [3000, 9090]
    assert gw.dial_port({"spec": {"clusterIP": "10.0.0.1", "ports": [{"port": 8080, "targetPort": 3000}]}},
                        8080) == 8080
    assert "names its targetPort 'named'" in str(gw.dial_port(headless, 8081))
    assert "has no port 1" in str(gw.dial_port(headless, 1))
    g = gateway(https("web", "a.example.test"))
    routes = (route("r", {"backendRefs": [{"name": "db", "port": 8080}]}),
              route("n", {"matches": [{"path": {"value": "/n"}}], "backendRefs": [{"name": "db", "port": 8081}]}))
    result = gw.as_ingress(g, routes, "corp", tag="tag:edge", hostname="edge",
                           services=lambda ns, name: headless, certificates=lambda ns, name: None,
                           labels=lambda ns: None)
    [host] = agent_hosts(result).values()
    assert sorted((r.path, r.backend.port if r.backend else None) for r in host.routes) == [("/", 3000), ("/n", None)]
    assert result.parents[("HTTPRoute", NS, "n")][0].resolved_refs.reason == "UnsupportedValue"


def test_a_gateway_with_a_long_name_is_served_under_a_cut_name() -> None:
    """The conformance suite names a Gateway gateway-secret-reference-grant-all-in-namespace."""
    long_name = "gateway-secret-reference-grant-all-in-namespace"
    g = gw.GatewayObject.model_validate({**gateway(https("web", "a.example.test")).model_dump(by_alias=True),
                                         "metadata": {"name": long_name, "namespace": NS, "uid": "u"}})
    result = plan(g, route("r", parents=({"name": long_name},)))
    assert result.ingress is not None, result.accepted
    agent = build.agent_name(result.ingress)
    assert len(agent) <= 63 and agent.startswith("gateway-secret-reference-grant"), agent
    assert gw.gateway_name_problem(long_name) is None
    assert gw.object_name_of(long_name) != gw.object_name_of(long_name + "-2")
    assert gw.object_name_of("edge") == "edge-gw"


def tcp_route(name: str, *backends: dict[str, Any], kind: str = "TCPRoute", hostnames: tuple[str, ...] = (),
              parents: tuple[dict[str, Any], ...] = ({"name": "edge"},), created: str = "2026-01-01T00:00:00Z"
              ) -> gw.RouteObject:
    return gw.RouteObject.model_validate({
        "kind": kind, "metadata": {"name": name, "namespace": NS, "creationTimestamp": created},
        "spec": {"parentRefs": list(parents), "hostnames": list(hostnames),
                 "rules": [{"backendRefs": list(backends) or [{"name": "web", "port": 5432}]}]}})


def exposes_of(result: gw.GatewayPlan) -> list[Any]:
    assert result.ingress is not None, result.accepted
    return list(parse_exposes(build.exposes_document(result.ingress, [])))


def test_a_tcp_listener_serves_its_oldest_tcproute_as_a_tcp_expose() -> None:
    g = gateway({"name": "db", "port": 5432, "protocol": "TCP"}, {"name": "web", "port": 80, "protocol": "HTTP"})
    result = plan(g, tcp_route("old", {"name": "api", "port": 5432}),
                  tcp_route("young", created="2026-02-01T00:00:00Z"), route("http", parents=({"name": "edge",
                                                                                               "sectionName": "db"},)))
    by_port = {e.port: e for e in exposes_of(result)}
    assert (by_port[5432].mode, by_port[5432].backend.host, by_port[5432].backend.port) == ("tcp", "api.shop.svc", 5432)
    assert by_port[80].mode == "http", "the HTTP listener is served beside it"
    [db, _] = result.listeners
    assert (db.attached_routes, db.supported_kinds) == (2, [{"group": gw.GROUP, "kind": "TCPRoute"}])
    assert result.parents[("TCPRoute", NS, "old")][0].accepted.status
    young = result.parents[("TCPRoute", NS, "young")][0].accepted
    assert (young.status, young.reason) == (False, "NotAllowedByListeners") and "older" in young.message
    http = result.parents[("HTTPRoute", NS, "http")][0].accepted
    assert (http.status, http.reason) == (False, "NotAllowedByListeners") and "TCP TCPRoutes" in http.message


def test_a_tcproute_goes_to_one_service_and_refuses_connections_when_it_has_none() -> None:
    g = gateway({"name": "db", "port": 5432, "protocol": "TCP"}, {"name": "web", "port": 80, "protocol": "HTTP"})
    weighted = plan(g, tcp_route("r", {"name": "api", "port": 1, "weight": 3}, {"name": "web", "port": 1, "weight": 1}))
    accepted = weighted.parents[("TCPRoute", NS, "r")][0].accepted
    assert (accepted.status, accepted.reason) == (False, "UnsupportedValue")
    drained = plan(g, tcp_route("r", {"name": "api", "port": 1, "weight": 0}, {"name": "web", "port": 2}))
    [tcp] = [e for e in exposes_of(drained) if e.mode == "tcp"]
    assert (tcp.backend.host, tcp.backend.port) == ("web.shop.svc", 2)
    missing = plan(g, tcp_route("r", {"name": "gone", "port": 1}))
    assert [e.mode for e in exposes_of(missing)] == ["http"], "no backend: the TCP port is not listened on"
    [parent] = missing.parents[("TCPRoute", NS, "r")]
    assert parent.accepted.status and parent.resolved_refs.reason == "BackendNotFound"


def test_a_gateway_of_tcp_listeners_without_routes_is_a_node_with_no_port_open() -> None:
    """Its addresses come before its first route, as users and the conformance suite expect."""
    g = gateway({"name": "db", "port": 5432, "protocol": "TCP"}, {"name": "again", "port": 5432, "protocol": "TCP"})
    result = plan(g)
    assert result.ingress is not None and result.ingress.spec.exposes == []
    assert (result.accepted.status, result.accepted.reason) == (True, "ListenersNotValid")
    again = next(c for c in result.listeners[1].conditions if c.type == "Accepted")
    assert (again.status, again.reason) == (False, "HostnameConflict")
    assert len(exposes_of(plan(g, tcp_route("r")))) == 1


def test_listener_protocols_beyond_http_https_tls_and_tcp_are_not_served() -> None:
    result = plan(gateway({"name": "dns", "port": 53, "protocol": "UDP"}))
    accepted = next(c for c in result.listeners[0].conditions if c.type == "Accepted")
    assert (accepted.status, accepted.reason) == (False, "UnsupportedProtocol")
    assert result.listeners[0].supported_kinds == [] and result.ingress is None
    assert (result.accepted.status, result.accepted.reason) == (False, "ListenersNotValid")
    terminate = plan(gateway({"name": "t", "port": 443, "protocol": "TLS", "tls": {"mode": "Terminate"}}))
    accepted = next(c for c in terminate.listeners[0].conditions if c.type == "Accepted")
    assert (accepted.status, accepted.reason) == (False, "UnsupportedValue")
    assert terminate.listeners[0].supported_kinds == [], "the conformance suite's TLSRouteListenerTerminateNotSupported"


def test_a_tls_passthrough_listener_serves_each_name_to_the_oldest_tlsroute_that_asks() -> None:
    g = gateway({"name": "vault", "port": 443, "protocol": "TLS", "hostname": "*.example.test",
                 "tls": {"mode": "Passthrough"}})
    result = plan(g, tls_route("a", ("a.example.test", "*.a.example.test"), "api"),
                  tls_route("b", ("b.example.test",), "web"),
                  tls_route("late", ("a.example.test",), "canary", created="2026-02-01T00:00:00Z"),
                  tls_route("far", ("x.elsewhere.test",), "web"))
    by_backend = {e.backend.host: e for e in exposes_of(result)}
    assert sorted(by_backend) == ["api.shop.svc", "web.shop.svc"]
    assert [h.name for h in by_backend["api.shop.svc"].hosts] == ["a.example.test", "*.a.example.test"]
    assert {e.mode for e in by_backend.values()} == {"tls"} and {e.port for e in by_backend.values()} == {443}
    late = result.parents[("TLSRoute", NS, "late")][0].accepted
    assert (late.status, late.reason) == (False, "NotAllowedByListeners")
    far = result.parents[("TLSRoute", NS, "far")][0].accepted
    assert (far.status, far.reason) == (False, "NoMatchingListenerHostname")
    assert result.listeners[0].supported_kinds == [{"group": gw.GROUP, "kind": "TLSRoute"}]
    assert result.listeners[0].attached_routes == 3


def test_a_tlsroute_on_an_http_listener_and_an_httproute_on_a_tls_listener_are_not_allowed() -> None:
    g = gateway({"name": "web", "port": 80, "protocol": "HTTP"},
                {"name": "vault", "port": 443, "protocol": "TLS", "tls": {"mode": "Passthrough"}})
    result = plan(g, tls_route("t", ("v.example.test",), "api", parents=({"name": "edge", "sectionName": "web"},)),
                  route("h", parents=({"name": "edge", "sectionName": "vault"},)))
    for key in (("TLSRoute", NS, "t"), ("HTTPRoute", NS, "h")):
        accepted = result.parents[key][0].accepted
        assert (accepted.status, accepted.reason) == (False, "NotAllowedByListeners"), key
    assert [ls.attached_routes for ls in result.listeners] == [0, 0]


def tls_route(name: str, hostnames: tuple[str, ...], service: str, **more: Any) -> gw.RouteObject:
    return tcp_route(name, {"name": service, "port": 8443}, kind="TLSRoute", hostnames=hostnames, **more)


def test_a_tcproutes_service_in_another_namespace_is_dialled_there_under_its_reference_grant() -> None:
    g = gateway({"name": "db", "port": 5432, "protocol": "TCP"})
    grant = {"metadata": {"namespace": "data"},
             "spec": {"from": [{"group": gw.GROUP, "kind": "TCPRoute", "namespace": NS}],
                      "to": [{"group": "", "kind": "Service"}]}}
    away = tcp_route("r", {"name": "pg", "namespace": "data", "port": 5432})
    [expose] = exposes_of(plan(g, away, services=frozenset({"pg"}), grants=(grant,)))
    assert (expose.backend.host, expose.backend.port) == ("pg.data.svc", 5432)
    refused = plan(g, away, services=frozenset({"pg"}))
    assert refused.parents[("TCPRoute", NS, "r")][0].resolved_refs.reason == "RefNotPermitted"
    assert refused.ingress is not None and refused.ingress.spec.exposes == [], "nothing served: no grant, no port"


def grpc_route(name: str, *rules: dict[str, Any], hostnames: tuple[str, ...] = ("rpc.example.test",),
               parents: tuple[dict[str, Any], ...] = ({"name": "edge"},), created: str = "2026-01-01T00:00:00Z"
               ) -> gw.RouteObject:
    return gw.RouteObject.model_validate({
        "kind": "GRPCRoute", "metadata": {"name": name, "namespace": NS, "creationTimestamp": created},
        "spec": {"parentRefs": list(parents), "hostnames": list(hostnames),
                 "rules": list(rules) or [{"backendRefs": [{"name": "api", "port": 50051}]}]}})


def test_a_grpcroute_on_an_https_listener_is_served_over_http2_by_service_and_method() -> None:
    rules = [{"matches": [{"method": {"service": "echo.Echo", "method": "Say"},
                           "headers": [{"name": "x-env", "value": "canary"}]}],
              "backendRefs": [{"name": "canary", "port": 50051}]},
             {"matches": [{"method": {"service": "echo.Echo"}}], "backendRefs": [{"name": "api", "port": 50051}]}]
    g = gateway(https("web", "*.example.test"))
    result = plan(g, grpc_route("rpc", *rules), route("shop", hostnames=("shop.example.test",)))
    exposes = {e.name: e for e in exposes_of(result)}
    assert sorted(exposes) == ["grpc-443-0", "https-443-0"]
    grpc = exposes["grpc-443-0"]
    assert grpc.backend.protocol == "h2" and exposes["https-443-0"].backend.protocol == "http1"
    [host] = grpc.hosts
    say, service = host.routes
    assert (host.name, say.path, say.type, say.headers[0].name) == ("rpc.example.test", "/echo.Echo/Say", "Exact",
                                                                    "x-env")
    assert (service.path, service.type, service.backend and service.backend.host) == ("/echo.Echo/", "Prefix",
                                                                                      "api.shop.svc")
    assert "shop.example.test" in [h.name for h in exposes["https-443-0"].hosts]
    assert result.parents[("GRPCRoute", NS, "rpc")][0].accepted.status


def test_a_grpcroute_on_an_http_listener_is_a_plaintext_expose_speaking_http2_to_its_backends() -> None:
    """gRPC in plaintext (h2c with prior knowledge, which the node tells from HTTP/1.1 by its
    preface): the GRPCRoute's hosts are a plaintext expose of the listener's port, beside the
    HTTPRoutes' plaintext expose, its backends spoken to over HTTP/2."""
    rules = [{"matches": [{"method": {"service": "echo.Echo", "method": "Say"}}],
              "backendRefs": [{"name": "api", "port": 50051}]}]
    g = gateway({"name": "web", "port": 80, "protocol": "HTTP"})
    result = plan(g, grpc_route("rpc", *rules), route("shop", hostnames=("shop.example.test",)))
    assert result.parents[("GRPCRoute", NS, "rpc")][0].accepted.status
    exposes = {e.name: e for e in exposes_of(result)}
    assert sorted(exposes) == ["grpc-80-0", "http-80-0"]
    grpc, http = exposes["grpc-80-0"], exposes["http-80-0"]
    assert (grpc.plaintext, grpc.port, grpc.backend.protocol) == (True, 80, "h2")
    assert (http.plaintext, http.backend.protocol) == (True, "http1")
    [host] = grpc.hosts
    [say] = host.routes
    assert (host.name, host.cert_file, say.path, say.type) == ("rpc.example.test", "", "/echo.Echo/Say", "Exact")
    assert say.backend is not None and (say.backend.host, say.backend.port) == ("api.shop.svc", 50051)
    assert "rpc.example.test" not in [h.name for h in http.hosts]
    status = gw.gateway_status(result, g, None, ready=False, current=None, now=NOW)
    assert status["listeners"][0]["supportedKinds"] == [{"group": gw.GROUP, "kind": "HTTPRoute"},
                                                        {"group": gw.GROUP, "kind": "GRPCRoute"}]
    assert status["listeners"][0]["attachedRoutes"] == 2


def test_an_http_listener_that_allows_only_httproutes_refuses_a_grpcroute() -> None:
    g = gateway({"name": "web", "port": 80, "protocol": "HTTP",
                 "allowedRoutes": {"kinds": [{"kind": "HTTPRoute"}]}})
    accepted = plan(g, grpc_route("rpc")).parents[("GRPCRoute", NS, "rpc")][0].accepted
    assert (accepted.status, accepted.reason) == (False, "NotAllowedByListeners")
    assert "HTTP and HTTPS take HTTPRoutes and GRPCRoutes" in accepted.message


def test_a_grpcroute_needs_a_service_to_match_and_names_no_httproute_has() -> None:
    g = gateway(https("web", "*.example.test"))
    any_service = plan(g, grpc_route("rpc", {"matches": [{"method": {"method": "Say"}}],
                                              "backendRefs": [{"name": "api", "port": 1}]}))
    accepted = any_service.parents[("GRPCRoute", NS, "rpc")][0].accepted
    assert (accepted.status, accepted.reason) == (False, "UnsupportedValue")
    shared = plan(g, route("shop", hostnames=("rpc.example.test",)),
                  grpc_route("rpc", created="2026-02-01T00:00:00Z"))
    accepted = shared.parents[("GRPCRoute", NS, "rpc")][0].accepted
    assert (accepted.status, accepted.reason) == (False, "NotAllowedByListeners"), "the older HTTPRoute has it"
    assert [e.name for e in exposes_of(shared)] == ["https-443-0"]
