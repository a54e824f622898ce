"""Registers the reconcilers with a manager: their watches, indexes and mappers."""

from __future__ import annotations

from collections.abc import Callable

from tailnet_operator.runtime.cache import SharedCache
from tailnet_operator.runtime.client import JSON
from tailnet_operator.runtime.controller import Request
from tailnet_operator.runtime.events import EventRecorder
from tailnet_operator.runtime.kinds import CONFIG_MAP, SECRET
from tailnet_operator.runtime.manager import Manager
from tailnet_operator.runtime.predicates import GenerationChanged

from .kinds import TAILNET, TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_INGRESS, TAILNET_SITE
from .policy import TAILNET_INDEX, PolicyReconciler, tailnet_ref_index
from .tailnet import ClientFactory, TailnetReconciler, default_client_factory, working_key_secret_name


def _tailnets_referencing(cache: SharedCache, matches: Callable[[JSON, JSON], bool]) -> Callable[[JSON], list[Request]]:
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


def setup(manager: Manager, *, namespace: str, events: EventRecorder,
          headscale: ClientFactory = default_client_factory) -> tuple[TailnetReconciler, PolicyReconciler]:
    """Add the Tailnet and Policy controllers to ``manager``; ``namespace`` is the operator's."""
    cache = manager.cache
    for resource in (TAILNET_SITE, TAILNET_EGRESS, TAILNET_INGRESS, TAILNET_GATEWAY):
        cache.add_indexer(resource, TAILNET_INDEX, tailnet_ref_index)
    cache.informer(TAILNET)

    tailnet = TailnetReconciler(client=manager.client, cache=cache, namespace=namespace, events=events,
                                headscale=headscale)
    (manager.controller("tailnet", tailnet)
     .for_(TAILNET, GenerationChanged())
     .watches(SECRET, _tailnets_referencing(cache, _refers(("bootstrapKeySecretRef",))))
     .watches(SECRET, _tailnets_referencing(cache, _refers(("caSecretRef",))))
     .watches(SECRET, _tailnets_referencing(cache, _working_key_of(namespace))))

    policy = PolicyReconciler(client=manager.client, cache=cache, namespace=namespace, events=events,
                              headscale=headscale)
    (manager.controller("policy", policy)
     .for_(TAILNET, GenerationChanged())
     .watches(TAILNET_SITE, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_EGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_INGRESS, _by_tailnet_ref, GenerationChanged())
     .watches(TAILNET_GATEWAY, _by_tailnet_ref, GenerationChanged())
     .watches(CONFIG_MAP, _tailnets_referencing(cache, _refers(("policy", "baseConfigMapRef"))))
     .watches(SECRET, _tailnets_referencing(cache, _working_key_of(namespace))))
    return tailnet, policy
