"""An Ingress of a tailnet IngressClass as the TailnetIngress it is served as: which class it
uses (by name, or the cluster's one default), hosts with TLS, paths (Exact, Prefix,
ImplementationSpecific as Prefix, rules without a host on every host), the default backend or 404,
named ports, and a problem that says what to change for everything that cannot be served."""

from __future__ import annotations

from typing import Any

import pytest

from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.api.ingress import PATHS_MAX
from tailnet_operator.resources import ingress as build
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.resources import loadbalancer as lb

PARAMS = {"apiGroup": "tailnet.dev", "kind": "Tailnet", "name": "tn"}


def klass(name: str = "tailnet", *, default: bool = False, controller: str = ic.CONTROLLER,
          parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    notes = {ic.DEFAULT_CLASS_ANNOTATION: "true"} if default else {}
    return {"metadata": {"name": name, "annotations": notes},
            "spec": {"controller": controller, "parameters": PARAMS if parameters is None else parameters}}


def backend(service: str, port: int | str = 80) -> dict[str, Any]:
    return {"service": {"name": service, "port": {"number": port} if isinstance(port, int) else {"name": port}}}


def path(p: str | None, service: str, kind: str = "Prefix", port: int | str = 80) -> dict[str, Any]:
    out: dict[str, Any] = {"pathType": kind, "backend": backend(service, port)}
    if p is not None:
        out["path"] = p
    return out


def ingress(rules: list[dict[str, Any]], *, tls: list[dict[str, Any]] | None = None, name: str = "shop",
            default: dict[str, Any] | None = None, annotations: dict[str, str] | None = None) -> ic.IngressObject:
    spec: dict[str, Any] = {"ingressClassName": "tailnet", "rules": rules,
                            "tls": [{"hosts": ["shop.example.test"], "secretName": "shop-tls"}] if tls is None else tls}
    if default is not None:
        spec["defaultBackend"] = default
    return ic.IngressObject.model_validate({"metadata": {"name": name, "namespace": "web", "uid": "u-1",
                                                         "annotations": annotations or {}}, "spec": spec})


SERVICES = {"api": {"spec": {"ports": [{"name": "http", "port": 8080}, {"name": "grpc", "port": 9090}]}}}
PORTS = ic.ports_of(SERVICES.get)


def rule(host: str | None, *paths: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"http": {"paths": list(paths)}}
    if host is not None:
        out["host"] = host
    return out


def shape(obj: ic.IngressObject) -> Any:
    return ic.as_ingress(obj, "tn", PORTS)


# -- the class --------------------------------------------------------------------------------------

def test_an_ingress_uses_the_class_it_names_or_the_clusters_one_default() -> None:
    ours, theirs = klass("tailnet"), klass("nginx", controller="k8s.io/ingress-nginx")
    named = {"spec": {"ingressClassName": "tailnet"}}
    assert ic.tailnet_of(named, [ours, theirs]) == "tn"
    assert ic.tailnet_of({"spec": {"ingressClassName": "nginx"}}, [ours, theirs]) is None
    assert ic.tailnet_of({"spec": {}}, [ours, theirs]) is None  # no default class
    assert ic.tailnet_of({"spec": {}}, [klass(default=True), theirs]) == "tn"
    assert ic.tailnet_of({"spec": {}}, [klass(default=True), klass("nginx", default=True,
                                                                   controller="k8s.io/ingress-nginx")]) is None
    assert ic.tailnet_of({"spec": {"ingressClassName": "missing"}}, [ours]) is None


@pytest.mark.parametrize("parameters", [
    {}, {**PARAMS, "kind": "ConfigMap"}, {**PARAMS, "apiGroup": "example.com"}, {**PARAMS, "scope": "Namespace"},
    {**PARAMS, "name": ""}])
def test_a_class_whose_parameters_name_no_tailnet_serves_nothing(parameters: dict[str, Any]) -> None:
    assert ic.tailnet_of_class(klass(parameters=parameters)) is None
    assert ic.tailnet_of_class(klass(parameters={**PARAMS, "scope": "Cluster"})) == "tn"


# -- the shape --------------------------------------------------------------------------------------

def test_rules_become_one_https_expose_whose_hosts_route_by_path() -> None:
    obj = ingress([rule("shop.example.test", path("/api", "api", port="http"), path("/api/v2", "v2", "Exact"),
                        path(None, "web", "ImplementationSpecific"))],
                  annotations={lb.HOSTNAME_ANNOTATION: "shop-gw", lb.TAG_ANNOTATION: "tag:shop"})
    shaped = shape(obj)
    assert (shaped.metadata.name, shaped.spec.hostname, shaped.spec.tag) == ("shop-ing", "shop-gw", "tag:shop")
    [expose] = shaped.spec.exposes
    assert (expose.name, expose.mode, expose.port) == ("https-0", "http", 443)
    [host] = expose.hosts or []
    assert (host.name, host.tls.secret_name, host.unmatched_paths) == ("shop.example.test", "shop-tls", "NotFound")
    assert [(p.path, p.path_type, p.backend.service, p.backend.port) for p in host.paths or []] == [
        ("/api", "Prefix", "api", 8080), ("/api/v2", "Exact", "v2", 80), ("/", "Prefix", "web", 80)]
    [agent] = parse_exposes(build.exposes_document(shaped, []))
    assert [(r.path, r.type, r.backend and r.backend.host) for r in agent.hosts[0].routes] == [
        ("/api", "Prefix", "api.web.svc"), ("/api/v2", "Exact", "v2.web.svc"), ("/", "Prefix", "web.web.svc")]
    assert not agent.hosts[0].fallback


def test_the_default_backend_serves_what_no_path_matches() -> None:
    shaped = shape(ingress([rule("shop.example.test", path("/api", "api"))], default=backend("web", 8080)))
    [expose] = shaped.spec.exposes
    assert (expose.backend.service, expose.backend.port) == ("web", 8080)
    assert (expose.hosts or [])[0].unmatched_paths == "Backend"
    only_default = shape(ingress([], default=backend("web")))  # a TLS host and nothing but the default
    assert (only_default.spec.exposes[0].hosts or [])[0].paths is None


def test_rules_without_a_host_apply_to_every_host_after_its_own() -> None:
    tls = [{"hosts": ["a.example.test", "b.example.test"], "secretName": "ab"}]
    shaped = shape(ingress([rule("a.example.test", path("/", "a")), rule(None, path("/", "any"),
                                                                         path("/static", "static"))], tls=tls))
    a, b = shaped.spec.exposes[0].hosts or []
    assert [(p.path, p.backend.service) for p in a.paths or []] == [("/", "a"), ("/", "any"), ("/static", "static")]
    assert [(p.path, p.backend.service) for p in b.paths or []] == [("/", "any"), ("/static", "static")]


def test_a_tls_entry_without_hosts_covers_the_rule_hosts_and_hosts_spread_over_exposes() -> None:
    names = [f"h{i}.example.test" for i in range(6)]
    shaped = shape(ingress([rule(n, path("/", "web")) for n in names], tls=[{"secretName": "wild"}]))
    assert [(e.name, [h.name for h in e.hosts or []]) for e in shaped.spec.exposes] == [
        ("https-0", names[:4]), ("https-1", names[4:])]
    assert {h.tls.secret_name for e in shaped.spec.exposes for h in e.hosts or []} == {"wild"}
    assert {e.port for e in shaped.spec.exposes} == {443}


@pytest.mark.parametrize(("obj", "reason", "words"), [
    (ingress([rule("other.example.test", path("/", "web"))]), "HostWithoutTLS",
     "other.example.test is in no spec.tls entry"),
    (ingress([rule("shop.example.test", {"path": "/", "pathType": "Prefix",
                                         "backend": {"resource": {"kind": "Bucket", "name": "b"}}})]),
     "ResourceBackend", "spec.rules[0].http.paths[0].backend names a resource backend (Bucket/b)"),
    (ingress([rule("shop.example.test", path("/", "api", port="metrics"))]), "BackendPortNotFound",
     "port 'metrics' of Service api"),
    (ingress([rule("shop.example.test", path("/", "gone", port="http"))]), "BackendPortNotFound",
     "Service gone"),
    (ingress([rule("*.example.test", path("/", "web"))], tls=[{"hosts": ["*.example.test"], "secretName": "w"}]),
     "WildcardHost", "*.example.test"),
    (ingress([], tls=[], default=backend("web")), "NoTLSHost", "names no host in spec.tls"),
    (ingress([], tls=[{"hosts": ["shop.example.test"]}], default=backend("web")), "TLSWithoutSecret",
     "spec.tls[0] names no secretName"),
    (ingress([rule(f"h{i}.example.test", path("/", "web")) for i in range(ic.MAX_HOSTS + 1)],
             tls=[{"secretName": "w"}]), "TooManyHosts", f"at most {ic.MAX_HOSTS}"),
    (ingress([rule("shop.example.test", *[path(f"/p{i}", "web") for i in range(PATHS_MAX + 1)])]),
     "TooManyPaths", f"at most {PATHS_MAX}"),
    (ingress([], name="x" * 50, default=backend("web")), "NameTooLong", "at most"),
    (ingress([]), "NoBackend", "neither a path nor a defaultBackend"),
])
def test_what_cannot_be_served_is_a_problem_that_says_what_to_change(obj: ic.IngressObject, reason: str,
                                                                       words: str) -> None:
    with pytest.raises(ic.Problem) as info:
        shape(obj)
    assert info.value.reason == reason
    assert words in info.value.message


# -- status and the sweep ------------------------------------------------------------------------

def test_the_status_is_the_load_balancer_classs_without_ip_mode() -> None:
    node = {"name": "shop-gw.tailnet.test.", "addresses": ["100.64.0.9", "fd7a:115c:a1e0::9"]}
    assert ic.ingress_status(node) == {"ingress": [{"hostname": "shop-gw.tailnet.test"}, {"ip": "100.64.0.9"},
                                                   {"ip": "fd7a:115c:a1e0::9"}]}
    assert ic.ingress_status(None) == {}


def test_the_sweep_counts_an_ingress_of_the_tailnets_class_with_its_tag() -> None:
    obj = {"metadata": {"name": "shop", "namespace": "web", "annotations": {lb.TAG_ANNOTATION: "tag:shop"}},
           "spec": {"ingressClassName": "tailnet"}}
    assert ic.sweep_view(obj, "tn", [klass()]) == {"metadata": obj["metadata"], "spec": {"tag": "tag:shop"}}
    assert ic.sweep_view(obj, "other", [klass()]) is None
