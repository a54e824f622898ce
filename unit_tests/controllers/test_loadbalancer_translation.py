"""The LoadBalancer class's pure part: which Services it serves, and the TailnetIngress a Service
is served as (its TCP ports as tcp exposes to the Service itself, hostname and tag from annotations)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tailnet_agent.contract.exposes import parse_exposes
from tailnet_operator.controllers.conditions import invalid_spec_message
from tailnet_operator.controllers.loadbalancer import CLASSED, ServiceStatus
from tailnet_operator.resources import ingress as build
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.runtime import SERVICE
from tailnet_operator.runtime.kinds import DEPLOYMENT
from tailnet_operator.types import JSON


def service(name: str = "web", *, ports: list[JSON] | None = None, annotations: dict[str, str] | None = None,
            type_: str = "LoadBalancer", cls: str | None = "tailnet.dev/tn", **spec: Any) -> JSON:
    body: JSON = {"type": type_, "ports": ports if ports is not None else [{"name": "http", "port": 80,
                                                                           "protocol": "TCP"}], **spec}
    if cls is not None:
        body["loadBalancerClass"] = cls
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "shop", "uid": "u-1", "annotations": annotations or {}},
            "spec": body}


def parsed(obj: JSON) -> lb.LoadBalancerService:
    return lb.LoadBalancerService.model_validate(obj)


def test_only_a_load_balancer_of_a_tailnet_class_names_a_tailnet() -> None:
    assert lb.load_balancer_class("tn") == "tailnet.dev/tn"
    assert lb.tailnet_of(service()) == "tn"
    assert lb.tailnet_of(service(cls=None)) is None
    assert lb.tailnet_of(service(cls="tailscale")) is None
    assert lb.tailnet_of(service(cls="tailnet.dev/")) is None
    assert lb.tailnet_of(service(type_="ClusterIP")) is None
    assert lb.tailnet_of({"metadata": {"name": "x"}}) is None


def test_the_watch_filter_passes_classed_services_and_the_update_that_takes_the_class_away() -> None:
    classed, plain = service(), service(cls=None)
    assert CLASSED.create(classed) and CLASSED.delete(classed)
    assert not CLASSED.create(plain) and not CLASSED.delete(plain)
    declassed = service(type_="ClusterIP", cls=None)
    assert CLASSED.update(classed, declassed)
    assert not CLASSED.update(plain, {**plain, "spec": {**plain["spec"], "ports": []}})
    with_status = {**classed, "status": {"loadBalancer": {"ingress": [{"ip": "100.64.0.1"}]}}}
    assert not CLASSED.update(classed, with_status)  # its own status write wakes nothing
    annotated = service(annotations={lb.HOSTNAME_ANNOTATION: "shop"})
    assert CLASSED.update(classed, annotated)


def test_defaults_are_the_namespace_and_name_as_hostname_and_tag_k8s() -> None:
    svc = parsed(service())
    assert (svc.hostname, svc.tag, svc.tailnet) == ("shop-web", "tag:k8s", "tn")
    assert lb.default_hostname("n" * 40, "s" * 40) == ("n" * 40 + "-" + "s" * 22)
    assert lb.default_hostname("a" * 62, "b") == "a" * 62


def test_annotations_set_hostname_and_tag_and_a_bad_one_names_the_annotation() -> None:
    svc = parsed(service(annotations={lb.HOSTNAME_ANNOTATION: "shop-gw", lb.TAG_ANNOTATION: "tag:shop-web"}))
    assert (svc.hostname, svc.tag) == ("shop-gw", "tag:shop-web")
    with pytest.raises(ValidationError) as caught:
        parsed(service(annotations={lb.HOSTNAME_ANNOTATION: "Not_A_Label", lb.TAG_ANNOTATION: "shop"}))
    message = invalid_spec_message(caught.value)
    assert "metadata.annotations.tailnet.dev/hostname" in message
    assert "metadata.annotations.tailnet.dev/tag" in message


def test_tcp_ports_become_tcp_exposes_to_the_service_itself() -> None:
    svc = parsed(service(ports=[{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
                                {"name": "dns", "port": 53, "protocol": "UDP"},
                                {"name": "https", "port": 443}],
                         annotations={lb.HOSTNAME_ANNOTATION: "shop-gw", lb.TAG_ANNOTATION: "tag:shop-web"}))

    ingress = lb.as_ingress(svc)

    assert ingress.metadata.name == "web-lb" and ingress.metadata.namespace == "shop"
    assert (ingress.spec.tailnet_ref.name, ingress.spec.tag, ingress.spec.hostname) == \
        ("tn", "tag:shop-web", "shop-gw")
    http, https = parse_exposes(build.exposes_document(ingress, []))
    assert (http.name, http.port, http.backend.host, http.backend.port) == ("http", 80, "web.shop.svc", 80)
    assert (https.name, https.port, https.backend.port) == ("https", 443, 443)
    assert [p.describe() for p in lb.skipped_ports(svc)] == ["UDP port dns 53"]
    assert build.agent_name(ingress) == "web-lb-ingress-agent"
    assert build.config_map_name(ingress) == build.config_map_name_of(lb.object_name_of("web"))  # by name alone


def test_an_unnamed_port_is_named_by_its_number() -> None:
    ingress = lb.as_ingress(parsed(service(ports=[{"port": 5432}])))
    assert [e.name for e in ingress.spec.exposes] == ["port-5432"]


@pytest.mark.parametrize(("ports", "name", "reason"), [
    ([{"name": "dns", "port": 53, "protocol": "UDP"}], "web", "NoTCPPorts"),
    ([{"name": f"p{i}", "port": 1000 + i} for i in range(9)], "web", "TooManyPorts"),
    ([{"port": 80}], "w" * 47, "NameTooLong"),
])
def test_a_service_the_node_cannot_serve_has_a_reason(ports: list[JSON], name: str, reason: str) -> None:
    problem = lb.problem(parsed(service(name, ports=ports)))
    assert problem is not None and problem[0] == reason


def test_the_longest_name_that_fits_still_makes_dns_label_objects() -> None:
    svc = parsed(service("w" * 46, ports=[{"port": 80}]))
    assert lb.problem(svc) is None
    assert len(build.agent_name(lb.as_ingress(svc))) == 63


def test_status_carries_the_magic_dns_name_and_each_address() -> None:
    node = {"id": "9", "name": "shop-gw.tailnet.test.", "addresses": ["100.64.0.9", "fd7a:115c:a1e0::9"]}
    assert lb.load_balancer_status(node) == {"ingress": [
        {"hostname": "shop-gw.tailnet.test"},
        {"ip": "100.64.0.9", "ipMode": "Proxy"}, {"ip": "fd7a:115c:a1e0::9", "ipMode": "Proxy"}]}
    bare = {"id": "9", "name": "shop-gw", "addresses": ["100.64.0.9"]}  # no MagicDNS name reported yet
    assert lb.load_balancer_status(bare) == {"ingress": [{"ip": "100.64.0.9", "ipMode": "Proxy"}]}
    assert lb.load_balancer_status(None) == {}


def test_the_record_lives_apart_from_an_ingress_record_and_names_the_tailnet() -> None:
    meta = lb.record_metadata(parsed(service()), "tailnet-system")
    assert meta["name"] == "loadbalancer.shop.web" != build.record_name("shop", "web")
    assert meta["namespace"] == "tailnet-system" and "ownerReferences" not in meta
    assert meta["labels"]["tailnet.dev/tailnet"] == "tn"


def test_the_sweep_sees_a_classed_service_with_its_tag() -> None:
    view = lb.sweep_view(service(annotations={lb.TAG_ANNOTATION: "tag:shop-web"}), "tn")
    assert view is not None and view["spec"] == {"tag": "tag:shop-web"}
    assert lb.sweep_view(service(), "other") is None
    assert lb.sweep_view(service(cls=None), "tn") is None


def test_a_service_status_keeps_only_what_a_service_status_has() -> None:
    body = {"metadata": {"name": "web"}, "status": {"conditions": [], "loadBalancer": {}, "preAuthKey": {},
                                                    "observedGeneration": 1}}
    assert ServiceStatus.shaped(SERVICE, body)["status"] == {"conditions": [], "loadBalancer": {}}
    assert ServiceStatus.shaped(DEPLOYMENT, body) is body
