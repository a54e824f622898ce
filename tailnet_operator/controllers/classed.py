"""A built-in object served as a tailnet node while it has a tailnet class: a Service of the
LoadBalancer class (:mod:`.loadbalancer`), an Ingress of the IngressClass (:mod:`.ingressclass`).

While the object has the class it is served through the pipeline (:mod:`.pipeline`) by its kind's
:class:`~.pipeline.TaggedNode`; when the class goes, or the object is being deleted, it is
released (:class:`ClassedReconciler`): its key expired (bounded like every finalizer:
:mod:`.cleanup`), its record deleted and, for an object that stays, the agent's objects deleted
and the status this controller wrote removed, before the finalizer comes off. The pipeline's own
deletion reads a CR's ``spec.tailnetRef``, which a built-in object has not: the Tailnet comes from
the record's label instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.names import TAILNET_LABEL, auth_key_secret_name
from tailnet_operator.resources import ingress as ingress_build
from tailnet_operator.runtime import CONFIG_MAP, SECRET, Request, Resource, Result, Writer, managed_paths
from tailnet_operator.runtime.errors import Forbidden, NotFound
from tailnet_operator.runtime.kinds import DEPLOYMENT, NETWORK_POLICY, SERVICE
from tailnet_operator.types import JSON

from . import finalizer
from .access import Deps, NoAccess
from .applier import Applier, Desired, owned_by
from .kinds import TAILNET_INGRESS
from .pipeline import NotReady, TaggedNode, TaggedNodeReconciler
from .preauth import AuthKey

__all__ = ["LISTED_KINDS", "SKIP_HINT", "Classed", "ClassedReconciler", "shape_objects"]

LISTED_KINDS = (DEPLOYMENT, SERVICE, NETWORK_POLICY)
"""What a served object owns in its namespace and the cache lists there: pruned when its class goes."""
SKIP_HINT = "expire it by hand (headscale preauthkeys expire), or let the orphan sweep do it"


def shape_objects(shape_name: str) -> list[tuple[Resource, str]]:
    """:meth:`Classed.named_objects` of a classed object whose TailnetIngress shape is ``shape_name``:
    the agent's key Secret and its exposes ConfigMap."""
    return [(SECRET, auth_key_secret_name(TAILNET_INGRESS.kind, shape_name)),
            (CONFIG_MAP, ingress_build.config_map_name_of(shape_name))]


class Classed(Protocol):
    """What a kind of classed object tells the reconciler beyond its pipeline node."""

    resource: Resource
    field_manager: str
    """The manager of the status the controller writes (removed on release)."""
    released: tuple[str, str]
    """The Normal Event (reason, message) of an object released while it stays."""

    def tailnet_of(self, obj: JSON) -> str | None:
        """The Tailnet the object's class names; None when it has no tailnet class (released)."""

    def named_objects(self, obj: JSON) -> list[tuple[Resource, str]]:
        """The agent's objects the cache does not list in the object's namespace (its key Secret and
        exposes ConfigMap), by the object's name alone: its spec may no longer be one the class serves."""

    def idle(self, obj: JSON) -> bool:
        """Whether the object is served but has nothing to listen to: it has no agent (one it had
        is deleted, so that nothing goes on forwarding), and the pipeline says why."""


class ClassedReconciler:
    """Serves a classed object through the pipeline; releases one whose class went or that is being
    deleted."""

    def __init__(self, deps: Deps, writer: Writer, node: TaggedNode[Any], classed: Classed) -> None:
        self.pipeline = TaggedNodeReconciler(deps, writer, node)
        self.phases = self.pipeline.phases
        self.node = node
        self.classed = classed
        self.reader, self.access, self.events = deps.reader, deps.access, deps.events
        self.writer = writer
        self.applier = Applier(deps.reader, writer, field_manager=classed.field_manager)

    async def reconcile(self, request: Request) -> Result:
        obj = self.reader.get(self.classed.resource, request.name, request.namespace or None)
        if obj is None:
            return Result()
        if self.classed.tailnet_of(obj) is None or obj["metadata"].get("deletionTimestamp"):
            return await self.release(obj)
        try:
            if self.classed.idle(obj):
                await self._delete_agent(obj)
            return await self.pipeline.reconcile(request)
        except Forbidden as exc:
            return await self.not_granted(obj, exc)

    async def not_granted(self, obj: JSON, exc: Forbidden) -> Result:
        """The finalizer could not be held: the operator may patch the object only in a namespace
        that granted it the tenant role (never cluster-wide). Say so in the status (which it may
        write anywhere), after the tenancy, which needs no write."""
        try:
            run = self.phases.parse(obj, self.node.tailnet_name)
            refusal = self.node.refusal(run, None)
            stop = NotReady.refused(refusal) if refusal is not None else NotReady(
                "False", "NamespaceNotGranted", self.node.not_granted(run, exc))
        except NotReady as found:
            stop = found
        return await self.phases.stop(obj, stop)

    async def release(self, obj: JSON) -> Result:
        """Undo what serving the object made; an object the operator never wrote to is not written to."""
        location = self.node.key_location(obj)
        record = self.reader.get(SECRET, *location)
        held = record is not None or finalizer.holds(obj)
        if not held and not self._wrote_status(obj):
            return Result()
        staying = not obj["metadata"].get("deletionTimestamp")
        if staying:
            await self._delete_agent(obj)
        if (stored := AuthKey.from_secret(record)) is not None:
            again = await self.phases.cleanup.run(obj, lambda: self._expire(obj, record, stored),
                                                  what=f"pre-auth key {stored.prefix}",
                                                  reason="PreAuthKeyNotExpired", hint=SKIP_HINT)
            if again is not None:
                return again
        if record is not None:
            with contextlib.suppress(NotFound):
                await self.writer.delete(SECRET, *location)
        if staying:
            await self._forget_status(obj)
        if staying and held:
            await self.events.normal(obj, *self.classed.released, action="Release")
        if finalizer.holds(obj):
            await finalizer.release(self.writer, self.classed.resource, obj)
        return Result()

    def _wrote_status(self, obj: JSON) -> bool:
        """Whether this controller owns fields of the object's status (a refusal before any
        finalizer, e.g. TailnetNotFound or NamespaceNotGranted, leaves only that). The entry a
        release leaves (``{"f:status": {}}``: the empty status it applied) owns none."""
        owned = managed_paths(obj, self.classed.field_manager, subresource="status")
        return any(path[:1] == ("f:status",) and len(path) > 1 for path in owned)

    async def _delete_agent(self, obj: JSON) -> None:
        """Delete what the object owns (garbage collection would not: the object stays). The kinds
        the cache lists everywhere are pruned; the Secret and ConfigMap, which it reads only by name
        outside the operator's namespaces, are found by their names."""
        namespace, uid = obj["metadata"]["namespace"], str(obj["metadata"]["uid"])
        await self.applier.apply(obj, Desired.of(prune=[(k, namespace) for k in LISTED_KINDS]))
        for resource, name in self.classed.named_objects(obj):
            found = self.reader.get(resource, name, namespace)
            if found is not None and owned_by(found, uid):
                with contextlib.suppress(NotFound):
                    await self.writer.delete(resource, name, namespace, uid=found["metadata"].get("uid"))

    async def _expire(self, obj: JSON, record: JSON | None, stored: AuthKey) -> None:
        """Expire the key on the Tailnet the record names (or the class, when it has no label)."""
        labels = (record or {}).get("metadata", {}).get("labels") or {}
        name = labels.get(TAILNET_LABEL) or self.classed.tailnet_of(obj)
        tailnet = self.reader.get(Tailnet, name or "")
        if tailnet is None:
            raise NoAccess(f"the Tailnet {name} is gone")
        async with self.access.open(self.access.working(tailnet)) as hs:
            await self.phases.keys.expire(hs, stored)
        await self.events.normal(obj, "PreAuthKeyExpired", f"expired pre-auth key {stored.prefix}", action="Expire")

    async def _forget_status(self, obj: JSON) -> None:
        """Remove what this controller wrote to the status (an apply that sends none of it)."""
        meta = obj["metadata"]
        await self.writer.apply_status(self.classed.resource,
                                       {"metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                                        "status": {}}, field_manager=self.classed.field_manager)
