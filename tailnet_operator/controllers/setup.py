"""Registers the reconcilers with a manager: their watches, indexes and mappers."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.monitoring import HeadscaleMetrics, StateCollector, register_build_info
from tailnet_operator.names import MANAGED_BY
from tailnet_operator.resources.gateway import GATEWAY_LABEL
from tailnet_operator.resources.gatewayapi import tailnet_of as gateway_tailnet
from tailnet_operator.resources.gatewayapi import tailnet_of_class as gateway_tailnet_of_class
from tailnet_operator.resources.ingressclass import tailnet_of as ingress_tailnet
from tailnet_operator.resources.ingressclass import tailnet_of_class
from tailnet_operator.runtime import (
    CONFIG_MAP,
    NAMESPACE,
    SECRET,
    Clock,
    Controller,
    EventRecorder,
    FieldChanged,
    GenerationChanged,
    Manager,
    Predicate,
    Reader,
    Reconciler,
    Request,
    Resource,
    SharedCache,
    any_of,
)
from tailnet_operator.runtime.kinds import (
    DEPLOYMENT,
    NETWORK_POLICY,
    POD,
    POD_DISRUPTION_BUDGET,
    SERVICE,
    STATEFUL_SET,
)
from tailnet_operator.types import JSON

from .access import (
    ClientFactory,
    Deps,
    HeadscaleAccess,
    default_client_factory,
    observed_client_factory,
    working_key_secret_name,
)
from .classed import ClassedReconciler
from .dns import FIELD_MANAGER as DNS_FIELD_MANAGER
from .dns import DnsReconciler, tailnet_of
from .egress import FIELD_MANAGER as EGRESS_FIELD_MANAGER
from .egress import EgressSettings, egress_reconciler
from .egress_status import AgentStatusReader
from .gateway import FIELD_MANAGER as GATEWAY_FIELD_MANAGER
from .gateway import GatewayReconciler, GatewaySettings
from .gatewayapi import CLASS_FIELD_MANAGER as GATEWAYCLASS_FIELD_MANAGER
from .gatewayapi import FIELD_MANAGER as GATEWAYAPI_FIELD_MANAGER
from .gatewayapi import (
    GatewayClassReconciler,
    classes_of_tailnet,
    gatewayapi_reconciler,
    gateways_near,
    gateways_of_class,
    gateways_of_grant,
    gateways_of_route,
    gateways_of_tailnet,
    gateways_selecting_namespaces,
    gateways_using_secret,
)
from .gatewayapi_plans import PARENT_INDEX, parent_index
from .ingress import FIELD_MANAGER as INGRESS_FIELD_MANAGER
from .ingress import IngressSettings, ingress_reconciler
from .ingress import secret_users as ingress_secret_users
from .ingressclass import FIELD_MANAGER as INGRESSCLASS_FIELD_MANAGER
from .ingressclass import ingressclass_reconciler, ingresses_of_class, ingresses_of_tailnet
from .kinds import (
    API_GATEWAY,
    GATEWAY_API_KINDS,
    GATEWAY_CLASS,
    INGRESS,
    INGRESS_CLASS,
    MODELS,
    REFERENCE_GRANT,
    ROUTE_RESOURCES,
    TAILNET,
    TAILNET_EGRESS,
    TAILNET_GATEWAY,
    TAILNET_INGRESS,
    TAILNET_SITE,
)
from .loadbalancer import CLASSED, LoadBalancerReconciler, loadbalancer_reconciler, services_of_tailnet
from .loadbalancer import FIELD_MANAGER as LOADBALANCER_FIELD_MANAGER
from .pipeline import TaggedNodeReconciler
from .policy import CLASS_INDEX, INDEXED, TAILNET_INDEX, PolicyReconciler, class_index, tailnet_ref_index
from .policy import FIELD_MANAGER as POLICY_FIELD_MANAGER
from .sweep import OrphanSweeper, SweepMetrics
from .tailnet import FIELD_MANAGER as TAILNET_FIELD_MANAGER
from .tailnet import TailnetReconciler


def _tailnets_referencing(cache: Reader, matches: Callable[[JSON, JSON], bool]) -> Callable[[JSON], list[Request]]:
    """A mapper from a Secret or ConfigMap to the Tailnets whose spec points at it."""

    def mapper(obj: JSON) -> list[Request]:
        return [Request("", t["metadata"]["name"]) for t in cache.list(TAILNET) if matches(t, obj)]

    return mapper


def _refers(ref_path: tuple[str, ...]) -> Callable[[JSON, JSON], bool]:
    def matches(tailnet: JSON, obj: JSON) -> bool:
        ref: object = tailnet.get("spec") or {}
        for part in ref_path:
            ref = ref.get(part) if isinstance(ref, dict) else None
        meta = obj["metadata"]
        return bool(isinstance(ref, dict) and ref.get("name") == meta["name"]
                    and ref.get("namespace") == meta.get("namespace"))

    return matches


def _working_key_of(namespace: str) -> Callable[[JSON, JSON], bool]:
    def matches(tailnet: JSON, obj: JSON) -> bool:
        meta = obj["metadata"]
        return bool(meta.get("namespace") == namespace
                    and meta["name"] == working_key_secret_name(tailnet["metadata"]["name"]))

    return matches


def _by_tailnet_ref(obj: JSON) -> list[Request]:
    return [Request("", name) for name in tailnet_ref_index(obj)]


def _tailnet_of_class(obj: JSON) -> list[Request]:
    return [Request("", name)] if (name := tailnet_of_class(obj)) else []


def _tailnets_of_ingress(cache: Reader) -> Callable[[JSON], list[Request]]:
    """An Ingress reaches the Tailnet its class names (its tag enters that Tailnet's policy)."""
    return lambda obj: [Request("", name)] if (name := ingress_tailnet(obj, cache.list(INGRESS_CLASS))) else []


def _tailnet_of_gateway_class(obj: JSON) -> list[Request]:
    return [Request("", name)] if (name := gateway_tailnet_of_class(obj)) else []


def _tailnets_of_gateway(cache: Reader) -> Callable[[JSON], list[Request]]:
    """A Gateway reaches the Tailnet its class names (its tag enters that Tailnet's policy)."""
    return lambda obj: [Request("", name)] if (name := gateway_tailnet(obj, cache.list(GATEWAY_CLASS))) else []


def _tailnets_of_route(cache: Reader) -> Callable[[JSON], list[Request]]:
    """An HTTPRoute reaches the Tailnets of the Gateways it names: the first route attached to a
    Gateway makes it one with something to serve, whose tag the policy must own."""
    def mapper(obj: JSON) -> list[Request]:
        classes = cache.list(GATEWAY_CLASS)
        names = []
        for request in gateways_of_route(obj):
            gateway = cache.get(API_GATEWAY, request.name, request.namespace)
            if gateway is not None and (name := gateway_tailnet(gateway, classes)):
                names.append(name)
        return [Request("", name) for name in dict.fromkeys(names)]

    return mapper


OWNED = MANAGED_BY
"""The label on every object the operator owns: its Deployment, Service and NetworkPolicy
informers watch only those, cluster-wide (the Role limits writes to the operator's namespace)."""

OPERATOR_LABELS = {"app.kubernetes.io/name": "tailnet-operator",
                   "app.kubernetes.io/component": "controller-manager"}
"""The operator pod's labels (manifests/install/deployment.yaml): agents admit it to /status."""


class Reconcilers(NamedTuple):
    tailnet: TailnetReconciler
    policy: PolicyReconciler
    egress: TaggedNodeReconciler[TailnetEgress]
    dns: DnsReconciler
    ingress: TaggedNodeReconciler[TailnetIngress]
    gateway: GatewayReconciler
    sweep: OrphanSweeper
    loadbalancer: LoadBalancerReconciler
    ingressclass: ClassedReconciler
    gatewayapi: ClassedReconciler
    gatewayclass: GatewayClassReconciler


TAILNET_ACCESS_CHANGED = any_of(GenerationChanged(), FieldChanged("status", "apiKey", "id"),
                                FieldChanged("status", "policy", "appliedHash"))
"""What an agent's CR waits for on its Tailnet: its spec, the working key (a first one ends
WaitingForAccess) and the applied policy (a render that owns a new tag ends TagNotOwned)."""


def _egresses_of_tailnet(cache: Reader, namespace: str) -> Callable[[JSON], list[Request]]:
    """A Tailnet's change (URL, CA, working key) reaches every egress that names it."""

    def mapper(obj: JSON) -> list[Request]:
        name = obj["metadata"]["name"]
        return [Request(namespace, e["metadata"]["name"])
                for e in cache.list(TAILNET_EGRESS, namespace, index=(TAILNET_INDEX, name))]

    return mapper


def _of_tailnets(cache: Reader, kind: Resource,
                 tailnets: Callable[[JSON], list[str]] | None = None) -> Callable[[JSON], list[Request]]:
    """A mapper to every ``kind`` object of the Tailnets ``tailnets`` names for an object (by
    default the object is the Tailnet: its change, URL, CA, zones or working key, reaches them)."""
    names = tailnets or (lambda tailnet: [tailnet["metadata"]["name"]])

    def mapper(obj: JSON) -> list[Request]:
        return [Request(o["metadata"].get("namespace") or "", o["metadata"]["name"]) for name in names(obj)
                for o in cache.list(kind, index=(TAILNET_INDEX, name))]

    return mapper


def _ingresses_using_secret(cache: Reader) -> Callable[[JSON], list[Request]]:
    """A TLS or CA Secret appearing, changing or going reaches the ingresses in its namespace that use it."""

    def mapper(obj: JSON) -> list[Request]:
        meta = obj["metadata"]
        namespace = meta.get("namespace") or ""
        return [Request(namespace, i["metadata"]["name"]) for i in cache.list(TAILNET_INGRESS, namespace)
                if meta["name"] in ingress_secret_users(i)]

    return mapper


GATEWAY = {**OWNED, "app.kubernetes.io/name": "tailnet-gateway"}
"""The labels of everything a TailnetGateway makes (resources/gateway.py, ``gateway_labels``)."""


def _gateway_of(obj: JSON) -> list[Request]:
    """An object a gateway made names it in the label ``tailnet.dev/gateway``."""
    name = (obj["metadata"].get("labels") or {}).get(GATEWAY_LABEL)
    return [Request("", name)] if name else []


def _sharing_hosts_file(cache: Reader) -> Callable[[JSON], list[Request]]:
    """A mapper from a Tailnet to the other Tailnets that name the same hosts ConfigMap (one of them
    holds it; the others wait for it to let go)."""
    matches = _refers(("dns", "hostsConfigMap"))

    def mapper(tailnet: JSON) -> list[Request]:
        ref = ((tailnet.get("spec") or {}).get("dns") or {}).get("hostsConfigMap")
        if not isinstance(ref, dict):
            return []
        named = {"metadata": {"name": ref.get("name"), "namespace": ref.get("namespace")}}
        return [Request("", t["metadata"]["name"]) for t in cache.list(TAILNET)
                if t["metadata"]["name"] != tailnet["metadata"]["name"] and matches(t, named)]

    return mapper


def _hosts_file_of(cache: Reader) -> Callable[[JSON], list[str]]:
    """The Tailnets whose ``spec.dns.hostsConfigMap`` is this ConfigMap."""
    matches = _refers(("dns", "hostsConfigMap"))
    return lambda obj: [t["metadata"]["name"] for t in cache.list(TAILNET) if matches(t, obj)]


def setup(manager: Manager, *, namespace: str, events: EventRecorder,
          headscale: ClientFactory = default_client_factory,
          clock: Clock | None = None, agent_image: str = "localhost/tailnet-operator:dev",
          agent_metrics_namespaces: dict[str, str] | None = None,
          tenant_role: str = "tailnet-operator-tenant", service_account: str = "tailnet-operator",
          gateway: GatewaySettings | None = None, agent_status: AgentStatusReader | None = None) -> Reconcilers:
    """Add the Tailnet, Policy, Egress, Ingress, DNS, Gateway, LoadBalancer and orphan-sweep controllers to
    ``manager``, and
    the operator's own metrics to its registry; ``namespace`` is the operator's.

    ``clock`` (default the manager's) is what the reconcilers read the time from; ``agent_image``
    is what the agent pods run; ``agent_metrics_namespaces`` selects (by labels) the namespaces
    whose pods the agents' NetworkPolicy admits to /metrics; ``tenant_role`` and
    ``service_account`` are what a namespace binds to let the operator write its TailnetIngresses'
    objects (named when it has not); ``gateway`` where the gateways' routers run; ``agent_status``
    how the agents' ``/status`` is read (default: over the cluster network, through each agent's
    status Service).
    """
    settings = gateway or GatewaySettings()
    cache = _prepare_cache(manager, (namespace, settings.namespace))
    if headscale is default_client_factory:
        headscale = observed_client_factory(HeadscaleMetrics(registry=manager.registry))
    register_build_info(manager.registry)
    by_kind = {resource.kind: resource for resource in MODELS.values()}
    manager.registry.register(StateCollector(lambda kind: cache.list(by_kind[kind]), by_kind))
    deps = Deps(reader=cache, access=HeadscaleAccess(cache, namespace, headscale), events=events,
                clock=clock or manager.clock)
    metrics_namespaces = dict(agent_metrics_namespaces or {})
    egress = egress_reconciler(deps, manager.writer(EGRESS_FIELD_MANAGER),
                               EgressSettings(agent_image=agent_image, operator_labels=OPERATOR_LABELS,
                                              metrics_namespaces=metrics_namespaces),
                               agent_status=agent_status)
    ingress_settings = IngressSettings(agent_image=agent_image, operator_namespace=namespace,
                                       operator_labels=OPERATOR_LABELS, tenant_role=tenant_role,
                                       service_account=service_account, metrics_namespaces=metrics_namespaces)
    ingress = ingress_reconciler(deps, manager.writer(INGRESS_FIELD_MANAGER), ingress_settings,
                                 agent_status=agent_status)
    tailnet, policy = _add_tailnet(manager, deps, namespace), _add_policy(manager, deps, namespace)
    _add_egress(manager, egress, namespace)
    _add_ingress(manager, ingress)
    dns = _add_dns(manager, namespace, events)
    gateways = _add_gateway(manager, deps, settings)
    loadbalancer = _add_loadbalancer(manager, loadbalancer_reconciler(
        deps, manager.writer(LOADBALANCER_FIELD_MANAGER), ingress_settings, agent_status=agent_status))
    ingressclass = _add_ingressclass(manager, ingressclass_reconciler(
        deps, manager.writer(INGRESSCLASS_FIELD_MANAGER), ingress_settings, agent_status=agent_status))
    gatewayapi = _add_gatewayapi(manager, gatewayapi_reconciler(
        deps, manager.writer(GATEWAYAPI_FIELD_MANAGER), ingress_settings, agent_status=agent_status))
    gatewayclass = GatewayClassReconciler(cache, manager.writer(GATEWAYCLASS_FIELD_MANAGER), deps.clock)
    (manager.controller("gatewayclass", gatewayclass)
     .for_(GATEWAY_CLASS, GenerationChanged())
     .watches(TAILNET, classes_of_tailnet(cache), GenerationChanged()))
    return Reconcilers(tailnet, policy, egress, dns, ingress, gateways, _add_sweep(manager, deps), loadbalancer,
                       ingressclass, gatewayapi, gatewayclass)


def _prepare_cache(manager: Manager, namespaces: tuple[str, str]) -> SharedCache:
    """The scheme, indexers and scopes every controller reads with.

    Secrets and ConfigMaps whole in the operator's and the gateway namespace, and neither listed
    nor watched anywhere else (no cluster-wide access): one read elsewhere (an ingress's TLS
    Secret, the hosts ConfigMap) is a GET, where the install lets the operator read
    (docs/reference/rbac.md)."""
    cache = manager.cache
    cache.scheme = cache.scheme.with_models(MODELS)
    for resource in (SECRET, CONFIG_MAP):
        cache.cache_in(resource, namespaces)
    for resource in INDEXED:
        cache.add_indexer(resource, TAILNET_INDEX, tailnet_ref_index)
    cache.add_indexer(INGRESS, CLASS_INDEX, class_index)
    for resource in GATEWAY_API_KINDS:  # installed apart from the operator, maybe never
        cache.tolerate_absent(resource)
    for resource in ROUTE_RESOURCES:
        cache.add_indexer(resource, PARENT_INDEX, parent_index)
    cache.informer(TAILNET)
    return cache


def _add_tailnet(manager: Manager, deps: Deps, namespace: str) -> TailnetReconciler:
    cache = manager.cache
    tailnet = TailnetReconciler(deps, manager.writer(TAILNET_FIELD_MANAGER))
    (manager.controller("tailnet", tailnet)
     .for_(TAILNET, GenerationChanged())
     .watches(SECRET, _tailnets_referencing(cache, _refers(("bootstrapKeySecretRef",))))
     .watches(SECRET, _tailnets_referencing(cache, _refers(("caSecretRef",))))
     .watches(SECRET, _tailnets_referencing(cache, _working_key_of(namespace))))
    return tailnet


def _add_policy(manager: Manager, deps: Deps, namespace: str) -> PolicyReconciler:
    cache = manager.cache
    policy = PolicyReconciler(deps, manager.writer(POLICY_FIELD_MANAGER))
    controller = (manager.controller("policy", policy)
     .for_(TAILNET, GenerationChanged())
     .watches(TAILNET_SITE, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_EGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_INGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_GATEWAY, _by_tailnet_ref, GenerationChanged())
     .watches(SERVICE, _by_tailnet_ref, CLASSED)
     .watches(INGRESS, _tailnets_of_ingress(cache), INGRESS_SERVED_CHANGED)
     .watches(INGRESS_CLASS, _tailnet_of_class, any_of(GenerationChanged(), FieldChanged("metadata", "annotations")))
     .watches(API_GATEWAY, _tailnets_of_gateway(cache), INGRESS_SERVED_CHANGED)
     .watches(GATEWAY_CLASS, _tailnet_of_gateway_class, GenerationChanged())
     .watches(CONFIG_MAP, _tailnets_referencing(cache, _refers(("policy", "baseConfigMapRef"))))
     .watches(SECRET, _tailnets_referencing(cache, _working_key_of(namespace))))
    for route in ROUTE_RESOURCES:
        controller.watches(route, _tailnets_of_route(cache), ROUTE_SERVED_CHANGED)
    return policy


def _agent_controller(manager: Manager, name: str, reconciler: Reconciler, resource: Resource,
                      predicate: Predicate, *, replicas: bool = False) -> Controller:
    """The controller of a kind served by an agent: it owns the agent's Deployment, Service and
    NetworkPolicy, and its PodDisruptionBudget for kinds with ``replicas``."""
    controller = manager.controller(name, reconciler).for_(resource, predicate)
    for kind in (DEPLOYMENT, SERVICE, NETWORK_POLICY, *((POD_DISRUPTION_BUDGET,) if replicas else ())):
        controller = controller.owns(kind, labels=OWNED)
    return controller


def _add_egress(manager: Manager, egress: TaggedNodeReconciler[TailnetEgress],
                namespace: str) -> TaggedNodeReconciler[TailnetEgress]:
    (_agent_controller(manager, "egress", egress, TAILNET_EGRESS, GenerationChanged(), replicas=True)
     .watches(TAILNET, _egresses_of_tailnet(manager.cache, namespace), TAILNET_ACCESS_CHANGED))
    return egress


def _add_ingress(manager: Manager,
                 ingress: TaggedNodeReconciler[TailnetIngress]) -> TaggedNodeReconciler[TailnetIngress]:
    cache = manager.cache
    (_agent_controller(manager, "ingress", ingress, TAILNET_INGRESS, GenerationChanged(), replicas=True)
     .watches(SECRET, _ingresses_using_secret(cache))
     .watches(TAILNET, _of_tailnets(cache, TAILNET_INGRESS), TAILNET_ACCESS_CHANGED))
    return ingress


def _add_loadbalancer(manager: Manager, loadbalancer: LoadBalancerReconciler) -> LoadBalancerReconciler:
    """Services are watched cluster-wide (the informer lists every Service: RBAC and the API offer no
    narrower filter), and only those of a tailnet class pass to the queue (:data:`.loadbalancer.CLASSED`)."""
    (_agent_controller(manager, "loadbalancer", loadbalancer, SERVICE, CLASSED)
     .watches(TAILNET, services_of_tailnet(manager.cache), TAILNET_ACCESS_CHANGED))
    return loadbalancer


INGRESS_SERVED_CHANGED = any_of(GenerationChanged(), FieldChanged("metadata", "annotations"),
                                FieldChanged("metadata", "deletionTimestamp"))
"""What an Ingress's reconcile waits for: its spec, its annotations (hostname, tag) and its deletion;
its own status writes wake nothing."""


def _ingresses_near(cache: Reader) -> Callable[[JSON], list[Request]]:
    """A Service's ports reach the Ingresses of its namespace (a backend may name a port by name)."""
    return lambda obj: [Request(i["metadata"]["namespace"], i["metadata"]["name"])
                        for i in cache.list(INGRESS, obj["metadata"].get("namespace"))]


def _add_ingressclass(manager: Manager, reconciler: ClassedReconciler) -> ClassedReconciler:
    """Ingresses and IngressClasses are watched cluster-wide; an Ingress of another class is read
    from the cache and left alone (:class:`.ingressclass.IngressClasses`)."""
    cache = manager.cache
    (_agent_controller(manager, "ingressclass", reconciler, INGRESS, INGRESS_SERVED_CHANGED)
     .watches(INGRESS_CLASS, ingresses_of_class(cache),
              any_of(GenerationChanged(), FieldChanged("metadata", "annotations")))
     .watches(SERVICE, _ingresses_near(cache), FieldChanged("spec", "ports"))
     .watches(TAILNET, ingresses_of_tailnet(cache), TAILNET_ACCESS_CHANGED))
    return reconciler


ROUTE_SERVED_CHANGED = any_of(GenerationChanged(), FieldChanged("metadata", "deletionTimestamp"))
"""What a route's Gateways wait for: its spec and its deletion; the status they write wakes nothing."""


def _add_gatewayapi(manager: Manager, reconciler: ClassedReconciler) -> ClassedReconciler:
    """Gateways, GatewayClasses and routes (HTTPRoute, GRPCRoute, TLSRoute, TCPRoute) are watched
    cluster-wide (once their CRDs are installed); a Gateway of another class is read from the cache
    and left alone."""
    cache = manager.cache
    controller = (_agent_controller(manager, "gatewayapi", reconciler, API_GATEWAY, INGRESS_SERVED_CHANGED)
     .watches(GATEWAY_CLASS, gateways_of_class(cache), GenerationChanged())
     .watches(SERVICE, gateways_near(cache), FieldChanged("spec", "ports"))
     .watches(SECRET, gateways_using_secret(cache))
     .watches(REFERENCE_GRANT, gateways_of_grant(cache))
     .watches(NAMESPACE, gateways_selecting_namespaces(cache), FieldChanged("metadata", "labels"))
     .watches(TAILNET, gateways_of_tailnet(cache), TAILNET_ACCESS_CHANGED))
    for route in ROUTE_RESOURCES:
        controller.watches(route, gateways_of_route, ROUTE_SERVED_CHANGED)
    return reconciler


def _add_dns(manager: Manager, namespace: str, events: EventRecorder) -> DnsReconciler:
    dns = DnsReconciler(manager.cache, manager.writer(DNS_FIELD_MANAGER), namespace=namespace, events=events)
    (manager.controller("dns", dns)
     .for_(TAILNET, GenerationChanged())
     .watches(TAILNET_EGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_INGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(SECRET, tailnet_of, namespace=namespace, labels=OWNED)  # an ingress record: its node's address
     .watches(SERVICE, tailnet_of, labels=OWNED)
     # A hosts file refused because another Tailnet held it is taken over as soon as that one goes
     # (its deletion, or the garbage collector removing the file), not at the next retry.
     .watches(CONFIG_MAP, _tailnets_referencing(manager.cache, _refers(("dns", "hostsConfigMap"))))
     .watches(TAILNET, _sharing_hosts_file(manager.cache)))
    return dns


def _add_gateway(manager: Manager, deps: Deps, settings: GatewaySettings) -> GatewayReconciler:
    cache = manager.cache
    gateways = GatewayReconciler(deps, manager.writer(GATEWAY_FIELD_MANAGER), settings)
    (manager.controller("gateway", gateways)
     .for_(TAILNET_GATEWAY, GenerationChanged())
     .watches(STATEFUL_SET, _gateway_of, namespace=settings.namespace, labels=GATEWAY)
     .watches(POD, _gateway_of, namespace=settings.namespace, labels=GATEWAY)
     .watches(DEPLOYMENT, _gateway_of, labels=OWNED)
     .watches(SERVICE, _gateway_of, labels=OWNED)
     .watches(SECRET, _gateway_of)
     .watches(CONFIG_MAP, _gateway_of)
     .watches(CONFIG_MAP, _of_tailnets(cache, TAILNET_GATEWAY, _hosts_file_of(cache)))
     .watches(TAILNET, _of_tailnets(cache, TAILNET_GATEWAY), GenerationChanged())
     .watches(TAILNET_EGRESS, _of_tailnets(cache, TAILNET_GATEWAY, tailnet_ref_index), GenerationChanged()))
    return gateways


def _add_sweep(manager: Manager, deps: Deps) -> OrphanSweeper:
    """Leader-only like every controller; each Tailnet requeues itself every sweep period."""
    sweep = OrphanSweeper(deps, metrics=SweepMetrics(registry=manager.registry))
    manager.controller("orphan-sweep", sweep).for_(TAILNET, GenerationChanged())
    return sweep
