"""Reads what the CLI's pure functions (:mod:`.logic`) judge: objects from kube-apiserver, and nodes,
policy and version from each Tailnet's Headscale with the operator's own working key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

from tailnet_operator import __version__
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.controllers.access import HeadscaleAccess, NoAccess, Problem, working_key_secret_name
from tailnet_operator.controllers.kinds import MODELS, TAILNET, TAILNET_EGRESS
from tailnet_operator.headscale import HeadscaleError
from tailnet_operator.runtime.cache.reading import TypedReader
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import KubeError, NotFound
from tailnet_operator.runtime.kinds import CUSTOM_RESOURCE_DEFINITION, DEPLOYMENT, LEASE, SECRET, Resource
from tailnet_operator.runtime.scheme import Scheme
from tailnet_operator.types import JSON

from .check import CheckFacts
from .facts import Facts, HeadscaleView, event_key

__all__ = ["KINDS", "check_facts", "egress_facts_all", "get_object", "headscale_view", "object_facts", "resolve_kind"]

POD = Resource("", "v1", "pods", "Pod")
CORE_EVENT = Resource("", "v1", "events", "Event")
KINDS: dict[str, Resource] = {r.kind.lower(): r for r in MODELS.values()}
HEADSCALE_TIMEOUT = 5.0


def resolve_kind(text: str) -> Resource:
    """``tailnetegress``, ``tailnetegresses``, ``TailnetEgress`` or a short name -> the resource."""
    key = text.lower()
    for resource in MODELS.values():
        if key in (resource.kind.lower(), resource.plural):
            return resource
    aliases = {"tn": TAILNET, "te": TAILNET_EGRESS, "egress": TAILNET_EGRESS, "tailnetegresses": TAILNET_EGRESS}
    if key in aliases:
        return aliases[key]
    raise KeyError(f"unknown kind {text!r}: one of {', '.join(sorted(KINDS))}")


class _Snapshot(TypedReader):
    """A read-only :class:`~tailnet_operator.runtime.client.interfaces.Reader` over objects fetched once."""

    def __init__(self, objects: Sequence[tuple[Resource, JSON]]) -> None:
        self.scheme = Scheme()
        self._objects = {(r, str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"])): o
                         for r, o in objects}

    def _get_raw(self, resource: Resource, name: str, namespace: str | None) -> JSON | None:
        return self._objects.get((resource, namespace or "", name))

    def _list_raw(self, resource: Resource, namespace: str | None, index: tuple[str, str] | None) -> list[JSON]:
        return [o for (r, ns, _), o in self._objects.items() if r == resource and namespace in (None, ns)]


async def get_object(client: Client, resource: Resource, name: str, namespace: str | None = None) -> JSON | None:
    try:
        obj = await client.get(resource, name, namespace)
    except NotFound:
        return None
    obj.setdefault("kind", resource.kind)
    return obj


async def headscale_view(client: Client, tailnet: JSON, operator_namespace: str) -> HeadscaleView:
    """Nodes, policy and version of the Tailnet's Headscale, read with the operator's working key."""
    try:
        model = Tailnet.model_validate(tailnet)
    except ValueError as exc:
        return HeadscaleView(error=f"the Tailnet does not parse: {exc}")
    objects: list[tuple[Resource, JSON]] = []
    secret_refs = [(working_key_secret_name(model.metadata.name or ""), operator_namespace)]
    if model.spec.ca_secret_ref is not None:
        secret_refs.append((model.spec.ca_secret_ref.name, model.spec.ca_secret_ref.namespace))
    for name, namespace in secret_refs:
        try:
            secret = await get_object(client, SECRET, name, namespace)
        except KubeError as exc:
            return HeadscaleView(error=f"cannot read the Secret {namespace}/{name}: {exc}")
        if secret is not None:
            objects.append((SECRET, secret))
    access = HeadscaleAccess(_Snapshot(objects), operator_namespace)
    try:
        connection = access.working(model)
    except NoAccess as exc:
        return HeadscaleView(error=str(exc), no_key=True)
    try:
        async with access.open(connection) as hs:
            async with asyncio.timeout(4 * HEADSCALE_TIMEOUT):
                version = await hs.version()
                nodes = await hs.list_nodes()
                policy = await hs.get_policy()
    except (HeadscaleError, Problem, TimeoutError) as exc:
        return HeadscaleView(error=f"{connection.url}: {exc}" if str(exc) else f"{connection.url}: timed out")
    return HeadscaleView(nodes=tuple(nodes), policy=policy.text, version=version)


async def _events(client: Client, objects: Sequence[JSON]) -> dict[str, list[JSON]]:
    out: dict[str, list[JSON]] = {}
    for obj in objects:
        kind, meta = str(obj.get("kind", "")), obj["metadata"]
        try:
            listed = await client.list(CORE_EVENT, None,
                                       field_selector=f"involvedObject.name={meta['name']},involvedObject.kind={kind}")
        except KubeError:
            continue
        key = event_key(kind, str(meta.get("namespace") or ""), str(meta["name"]))
        out[key] = [e for e in listed.items
                    if str((e.get("involvedObject") or {}).get("namespace") or "") == str(meta.get("namespace") or "")]
    return out


async def object_facts(client: Client, resource: Resource, name: str, namespace: str, *,
                       operator_namespace: str, with_headscale: bool = True) -> Facts | None:
    """Everything :func:`~.status.object_status` needs about one object; None when it does not exist."""
    obj = await get_object(client, resource, name, namespace if resource.namespaced else None)
    if obj is None:
        return None
    ref = str(((obj.get("spec") or {}).get("tailnetRef") or {}).get("name") or "")
    tailnet = obj if resource == TAILNET else (await get_object(client, TAILNET, ref) if ref else None)
    pods: tuple[JSON, ...] = ()
    if resource == TAILNET_EGRESS:
        listed = await client.list(POD, namespace, label_selector=f"tailnet.dev/egress={name}")
        pods = tuple({**p, "kind": "Pod"} for p in listed.items)
    view = None
    if with_headscale and tailnet is not None and resource != TAILNET:
        view = await headscale_view(client, tailnet, operator_namespace)
    events = await _events(client, [o for o in (obj, tailnet, *pods) if o is not None])
    return Facts(now=datetime.now(UTC), obj=obj, tailnet=tailnet, pods=pods, headscale=view, events=events)


async def egress_facts_all(client: Client, operator_namespace: str) -> tuple[list[JSON], dict[str, Facts]]:
    """Every TailnetEgress of the operator's namespace and, for each, its status facts."""
    listed = await client.list(TAILNET_EGRESS, operator_namespace)
    egresses = [{**e, "kind": "TailnetEgress"} for e in listed.items]
    facts: dict[str, Facts] = {}
    for egress in egresses:
        name = egress["metadata"]["name"]
        found = await object_facts(client, TAILNET_EGRESS, name, operator_namespace,
                                   operator_namespace=operator_namespace)
        if found is not None:
            facts[name] = found
    return egresses, facts


async def check_facts(client: Client, operator_namespace: str) -> CheckFacts:
    """The installation as :func:`~.check.check` judges it."""
    version = await client.request("GET", "/version")
    crds = await client.list(CUSTOM_RESOURCE_DEFINITION)
    ours = tuple(c for c in crds.items if str((c.get("spec") or {}).get("group")) == "tailnet.dev")
    deployments = await client.list(DEPLOYMENT, operator_namespace,
                                     label_selector="app.kubernetes.io/component=controller-manager")
    deployment = next((d for d in deployments.items
                       if (d["metadata"].get("labels") or {}).get("app.kubernetes.io/part-of") == "tailnet-operator"
                       or d["metadata"]["name"] == "tailnet-operator"), None)
    lease = await get_object(client, LEASE, "tailnet-operator", operator_namespace)
    tailnets: tuple[JSON, ...] = ()
    views: dict[str, HeadscaleView] = {}
    if any((c.get("spec") or {}).get("names", {}).get("kind") == "Tailnet" for c in ours):
        tailnets = tuple((await client.list(TAILNET)).items)
        for tailnet in tailnets:
            views[tailnet["metadata"]["name"]] = await headscale_view(client, tailnet, operator_namespace)
    return CheckFacts(now=datetime.now(UTC), cli_version=__version__,
                      kubernetes_version=str(version.get("gitVersion", "")), crds=ours, deployment=deployment,
                      lease=lease, tailnets=tailnets, headscale=views, namespace=operator_namespace)
