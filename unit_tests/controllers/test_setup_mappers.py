"""setup()'s mappers: which reconcile requests a change of a watched object makes (and which it
must not), on the fake client with the operator's indexers."""

from __future__ import annotations

from typing import Any

from tailnet_operator.controllers import setup as wiring
from tailnet_operator.controllers.ingressclass import ingresses_of_class, ingresses_of_tailnet
from tailnet_operator.controllers.kinds import INGRESS, INGRESS_CLASS, TAILNET, TAILNET_EGRESS, TAILNET_INGRESS
from tailnet_operator.names import working_key_secret_name
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.resources.gateway import GATEWAY_LABEL
from tailnet_operator.runtime import Request
from tailnet_operator.types import JSON

from .harness import NAMESPACE, URL, World

TENANT = "tenant"
TLS_HOST = {"name": "shop.apps.example.internal", "tls": {"secretName": "shop-tls"}}
WEB = {"name": "web", "mode": "http", "port": 443, "backend": {"service": "web", "port": 8080}, "hosts": [TLS_HOST]}


def tailnet(world: World, name: str, **spec: Any) -> JSON:
    body = {"loginURL": URL, "bootstrapKeySecretRef": {"namespace": NAMESPACE, "name": f"{name}-bootstrap",
                                                       "key": "apiKey"}, **spec}
    return world.kube.add(TAILNET, {"metadata": {"name": name}, "spec": body})


def egress(world: World, name: str, tailnet_name: str, namespace: str = NAMESPACE) -> JSON:
    return world.kube.add(TAILNET_EGRESS, {"metadata": {"name": name, "namespace": namespace}, "spec": {
        "tailnetRef": {"name": tailnet_name}, "tag": "tag:e", "consumerNamespaces": ["apps"],
        "targets": [{"name": name, "address": "198.18.1.10", "ports": [{"port": 5432}]}]}})


def ingress(world: World, name: str, tailnet_name: str, exposes: list[JSON]) -> JSON:
    return world.kube.add(TAILNET_INGRESS, {"metadata": {"name": name, "namespace": TENANT}, "spec": {
        "tailnetRef": {"name": tailnet_name}, "tag": "tag:i", "hostname": name, "exposes": exposes}})


def secret(name: str, namespace: str) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace}}


def test_a_secret_reaches_the_tailnets_whose_spec_names_it_in_that_namespace_only() -> None:
    world = World()
    tailnet(world, "a")
    tailnet(world, "b")
    bootstrap = wiring._tailnets_referencing(world.kube, wiring._refers(("bootstrapKeySecretRef",)))

    assert bootstrap(secret("a-bootstrap", NAMESPACE)) == [Request("", "a")]
    assert bootstrap(secret("a-bootstrap", "elsewhere")) == []
    assert bootstrap(secret("unrelated", NAMESPACE)) == []


def test_a_working_key_secret_reaches_its_tailnet_only_in_the_operator_namespace() -> None:
    world = World()
    tailnet(world, "a")
    tailnet(world, "b")
    working = wiring._tailnets_referencing(world.kube, wiring._working_key_of(NAMESPACE))

    assert working(secret(working_key_secret_name("b"), NAMESPACE)) == [Request("", "b")]
    assert working(secret(working_key_secret_name("b"), TENANT)) == []


def test_a_cr_reaches_its_tailnet_and_a_tailnet_reaches_its_crs() -> None:
    world = World()
    tailnet(world, "a")
    tailnet(world, "b")
    egress(world, "db", "a")
    egress(world, "cache", "b")
    egress(world, "stray", "a", namespace=TENANT)  # outside the operator's namespace: never acted on
    ingress(world, "shop", "a", [WEB])

    assert wiring._by_tailnet_ref(egress(world, "other", "b")) == [Request("", "b")]
    assert wiring._egresses_of_tailnet(world.kube, NAMESPACE)(tailnet(world, "a2")) == []
    assert wiring._egresses_of_tailnet(world.kube, NAMESPACE)(world.tailnet_obj("a")) == [Request(NAMESPACE, "db")]
    assert wiring._of_tailnets(world.kube, TAILNET_INGRESS)(world.tailnet_obj("a")) == [Request(TENANT, "shop")]
    assert wiring._of_tailnets(world.kube, TAILNET_INGRESS)(world.tailnet_obj("b")) == []


def test_a_tls_secret_reaches_the_ingresses_of_its_namespace_that_use_it() -> None:
    world = World()
    tailnet(world, "a")
    ingress(world, "shop", "a", [WEB])
    ingress(world, "plain", "a", [{"name": "db", "port": 5432, "backend": {"service": "pg", "port": 5432}}])
    using = wiring._ingresses_using_secret(world.kube)

    assert using(secret("shop-tls", TENANT)) == [Request(TENANT, "shop")]
    assert using(secret("shop-tls", NAMESPACE)) == [], "the same name in another namespace is another Secret"
    assert using(secret("other-tls", TENANT)) == []


def test_a_gateway_object_reaches_its_gateway_by_label_and_a_hosts_file_its_tailnets() -> None:
    world = World()
    dns = {"hostsConfigMap": {"namespace": "kube-system", "name": "tailnet-hosts"}, "zones": ["example.internal"]}
    tailnet(world, "a", dns=dns)
    tailnet(world, "b")

    labelled = {"metadata": {"name": "x", "labels": {GATEWAY_LABEL: "edge"}}}
    assert wiring._gateway_of(labelled) == [Request("", "edge")]
    assert wiring._gateway_of({"metadata": {"name": "x"}}) == []
    hosts = wiring._hosts_file_of(world.kube)
    assert hosts({"metadata": {"name": "tailnet-hosts", "namespace": "kube-system"}}) == ["a"]
    assert hosts({"metadata": {"name": "tailnet-hosts", "namespace": "default"}}) == []


def test_ingresses_are_reached_through_their_class_and_its_tailnet() -> None:
    world = World()
    params = {"apiGroup": "tailnet.dev", "kind": "Tailnet"}
    ours = world.kube.add(INGRESS_CLASS, {"metadata": {"name": "tailnet"}, "spec": {
        "controller": ic.CONTROLLER, "parameters": {**params, "name": "a"}}})
    world.kube.add(INGRESS_CLASS, {"metadata": {"name": "nginx"}, "spec": {"controller": "k8s.io/ingress-nginx"}})
    for name, cls in (("shop", "tailnet"), ("blog", "nginx"), ("bare", None)):
        spec = {"ingressClassName": cls} if cls else {}
        world.kube.add(INGRESS, {"metadata": {"name": name, "namespace": TENANT}, "spec": spec})

    assert ingresses_of_tailnet(world.kube)({"metadata": {"name": "a"}}) == [Request(TENANT, "shop")]
    assert ingresses_of_tailnet(world.kube)({"metadata": {"name": "b"}}) == []
    assert ingresses_of_class(world.kube)(ours) == [Request(TENANT, "shop")]
    default = {**ours, "metadata": {"name": "tailnet", "annotations": {ic.DEFAULT_CLASS_ANNOTATION: "true"}}}
    assert ingresses_of_class(world.kube)(default) == [Request(TENANT, "shop"), Request(TENANT, "bare")]
    # the policy: an Ingress reaches the Tailnet its class names, a class the Tailnet it names
    assert wiring._tailnets_of_ingress(world.kube)(world.kube.get(INGRESS, "shop", TENANT) or {}) == [Request("", "a")]
    assert wiring._tailnets_of_ingress(world.kube)(world.kube.get(INGRESS, "blog", TENANT) or {}) == []
    assert wiring._tailnet_of_class(ours) == [Request("", "a")]
    # a Service's ports reach the Ingresses of its namespace (a backend may name a port)
    assert {r.name for r in wiring._ingresses_near(world.kube)({"metadata": {"name": "api", "namespace": TENANT}})} \
        == {"shop", "blog", "bare"}
    assert wiring._ingresses_near(world.kube)({"metadata": {"name": "api", "namespace": "elsewhere"}}) == []
