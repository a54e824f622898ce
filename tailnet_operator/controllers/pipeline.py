"""The one pipeline of every reconciler that runs a tagged tailnet node.

A kind (egress, ingress, and the front doors to come) says what is its own through
:class:`TaggedNode`: its tag, its tenancy, the objects it wants. :class:`TaggedNodeReconciler`
runs the same phases for each, in this order, so that nothing reaches the tailnet unless the
policy owns the tag:

1. **load**: the CR from the cache; a CR being deleted has its key expired behind the finalizer
   (bounded, or skipped: :mod:`.cleanup`) and is let go;
2. **parse**: the spec (``InvalidSpec`` names every field at fault), the Tailnet
   (``TailnetNotFound``), the kind's own checks; the finalizer is held from here on;
3. **identity**: the kind's tenancy (a CR that may not use the Tailnet as it asks is refused and,
   if it had a key, loses it and its nodes), the Headscale connection (``WaitingForAccess``,
   ``HeadscaleUnavailable``), the tag against the live policy (``TagNotOwned``), the pre-auth key;
4. **apply**: the kind's complete desired set through one :class:`~.applier.Applier`, which prunes
   what the CR owns and no longer wants;
5. **status**: the kind's conditions and fields beside the key's.

Any phase stops the reconcile by raising :class:`NotReady`: one way to say why a CR is not ready,
with the other conditions kept as they were. :class:`Phases` holds the steps as parts, which the
gateway composes into its create-once state machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, Protocol, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node
from tailnet_operator.policy import PolicyParseError, missing
from tailnet_operator.policy.derive import Derived
from tailnet_operator.runtime import (
    SECRET,
    Request,
    Resource,
    Result,
    Writer,
)
from tailnet_operator.runtime.errors import Forbidden, NotFound
from tailnet_operator.tenancy import Refusal
from tailnet_operator.types import JSON

from . import finalizer, periods
from .access import Connection, Deps, NoAccess
from .applier import Applied, Applier, Desired, owned_by
from .cleanup import Cleanup
from .conditions import Cond, Status, invalid_spec_message
from .preauth import AuthKey, AuthKeyKeeper, Wanted
from .status import StatusWriter

__all__ = ["NotReady", "Outcome", "Phases", "Run", "TaggedNode", "TaggedNodeReconciler", "node_status"]

log = structlog.get_logger("controllers.pipeline")

CR = TypeVar("CR", bound=BaseModel)


@dataclass(frozen=True)
class Run(Generic[CR]):
    """One reconcile of one CR: as cached (``obj``), as parsed (``cr``), and its Tailnet."""

    obj: JSON
    cr: CR
    tailnet: Tailnet

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.obj["metadata"].get("namespace") or "")

    @property
    def uid(self) -> str:
        return str(self.obj["metadata"]["uid"])


class NotReady(Exception):
    """Stops a reconcile: Ready (and ``also``) is written, the kind's other conditions are kept,
    and the CR is looked at again after ``requeue_after`` seconds (None: when it changes)."""

    def __init__(self, status: Status, reason: str, message: str, *,
                 requeue_after: float | None = periods.AGENT_RESYNC, also: Iterable[Cond] = (),
                 warning: bool = False) -> None:
        super().__init__(reason, message)
        self.status, self.reason, self.message = status, reason, message
        self.also = tuple(also)
        self.requeue_after = requeue_after
        self.warning = warning
        """Also a Warning Event (a refusal a person must act on)."""

    @property
    def conditions(self) -> list[Cond]:
        return [Cond("Ready", self.status, self.reason, self.message), *self.also]

    @classmethod
    def refused(cls, refusal: Refusal) -> NotReady:
        return cls("False", refusal.reason, refusal.message, warning=True)


@dataclass(frozen=True)
class Outcome:
    """What the identity and apply phases found and did, for the kind's status."""

    key: AuthKey
    live_policy: str
    nodes: list[Node]
    applied: Applied
    headscale: HeadscaleClient
    """Open while the kind reports, for what the status phase tidies (an ingress's old nodes)."""


class TaggedNode(Protocol[CR]):
    """What one kind of tagged-node CR adds to the pipeline."""

    resource: Resource
    model: type[CR]
    field_manager: str
    condition_types: tuple[str, ...]
    """The conditions besides Ready that a not-ready status keeps as they are."""

    def accepts(self, request: Request) -> bool:
        """Whether the CR is acted on at all (a kind confined to one namespace says no elsewhere)."""
        ...

    def spec_problem(self, run: Run[CR]) -> tuple[str, str] | None:
        """(reason, message) of a spec the schema allows but this operator cannot serve."""
        ...

    def tailnet_name(self, cr: CR) -> str:
        """The Tailnet the CR belongs to (its ``spec.tailnetRef`` for the project's own kinds)."""
        ...

    def tag(self, cr: CR) -> str: ...

    def derived(self, cr: CR) -> Derived:
        """What the policy must hold for the CR, to check the live policy owns its tag."""
        ...

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """(name, namespace) of the Secret that records the CR's pre-auth key."""
        ...

    def key_metadata(self, run: Run[CR]) -> JSON:
        """The metadata of that Secret (owner, labels)."""
        ...

    def refusal(self, run: Run[CR], live_policy: str | None) -> Refusal | None:
        """Why the CR may not use the Tailnet as it asks (None when it may); ``live_policy`` is
        None for the check made before Headscale is asked, for a CR that has no key yet."""
        ...

    def before_key(self, run: Run[CR]) -> Desired:
        """Objects applied before a key is made (a write the namespace refuses stops there)."""
        ...

    def desired(self, run: Run[CR], key: AuthKey) -> Desired:
        """Every object the CR should have, and where leftovers are pruned."""
        ...

    def not_granted(self, run: Run[CR], exc: Forbidden) -> str:
        """What a person does when the API server refuses the operator's writes for this CR."""
        ...

    async def report(self, run: Run[CR], outcome: Outcome) -> tuple[list[Cond], JSON]:
        """The kind's conditions (Ready among them) and status fields."""
        ...


class Phases(Generic[CR]):
    """The steps of a tagged-node reconcile of ``resource``, as parts to compose."""

    def __init__(self, deps: Deps, writer: Writer, resource: Resource, model: type[CR], *,
                 field_manager: str, condition_types: tuple[str, ...]) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.writer = writer
        self.resource = resource
        self.model = model
        self.condition_types = condition_types
        self.status = StatusWriter(writer, deps.clock, field_manager=field_manager)
        self.keys = AuthKeyKeeper(writer, deps.clock, field_manager=field_manager)
        self.cleanup = Cleanup(deps.events, deps.clock)

    # -- load and parse -------------------------------------------------------------------------

    def load(self, request: Request) -> JSON | None:
        return self.reader.get(self.resource, request.name, request.namespace or None)

    def parse(self, obj: JSON, tailnet_name: Callable[[CR], str]) -> Run[CR]:
        """The CR and its Tailnet; :class:`NotReady` when the spec does not parse or the Tailnet is gone."""
        try:
            cr = self.model.model_validate(obj)
        except ValidationError as exc:
            raise NotReady("False", "InvalidSpec", invalid_spec_message(exc), requeue_after=None) from None
        ref = tailnet_name(cr)
        tailnet = self.reader.get(Tailnet, ref)
        if tailnet is None:
            raise NotReady("False", "TailnetNotFound", f"the Tailnet {ref} does not exist")
        return Run(obj, cr, tailnet)

    async def hold_finalizer(self, obj: JSON) -> None:
        await finalizer.hold(self.writer, self.resource, obj)

    # -- identity -------------------------------------------------------------------------------

    def connection(self, tailnet: Tailnet) -> Connection:
        """The Tailnet's Headscale with its working key; otherwise ``WaitingForAccess``."""
        try:
            return self.access.working(tailnet)
        except NoAccess as exc:
            raise NotReady("Unknown", "WaitingForAccess", str(exc), requeue_after=periods.HEADSCALE_RETRY) from None

    @contextlib.asynccontextmanager
    async def headscale(self, connection: Connection) -> AsyncIterator[HeadscaleClient]:
        """A Headscale client; a Headscale failure inside becomes ``HeadscaleUnavailable``."""
        try:
            async with self.access.open(connection) as hs:
                yield hs
        except (HeadscaleError, PolicyParseError) as exc:
            raise NotReady("Unknown", "HeadscaleUnavailable", f"Headscale: {exc}",
                           requeue_after=periods.HEADSCALE_RETRY) from None

    @staticmethod
    def check_tag(live: str, derived: Derived, tag: str) -> None:
        """``TagNotOwned``, with the snippet that fixes it, unless the live policy owns ``tag``."""
        gap = missing(live or None, derived)
        if tag not in gap.tags:
            return
        message = (f"the live policy does not own {tag}; nothing was created on the tailnet. "
                   f"Add this to the policy (or set spec.policy on the Tailnet to let the operator do it):\n"
                   f"{gap.snippet}")
        raise NotReady("False", "TagNotOwned", message, also=[Cond("TagOwned", "False", "TagNotOwned", message)])

    def stored_key(self, location: tuple[str, str | None]) -> AuthKey | None:
        return AuthKey.from_secret(self.reader.get(SECRET, *location))

    async def ensure_key(self, hs: HeadscaleClient, obj: JSON, location: tuple[str, str | None], metadata: JSON,
                         tailnet: Tailnet, tag: str, *, single_use: bool = False) -> AuthKey:
        """The CR's pre-auth key, created or rotated when due (a Normal Event says why): reusable
        and ephemeral for an agent, or ``single_use`` and not ephemeral (one node, which stays)."""
        wanted = Wanted(login_url=str(tailnet.spec.login_url), tag=tag,
                        reusable=not single_use, ephemeral=not single_use)
        key, reason = await self.keys.ensure(hs, metadata, self.stored_key(location), wanted)
        if reason:
            await self.events.normal(obj, "PreAuthKeyRotated", f"new pre-auth key {key.prefix} ({reason})",
                                     action="Rotate")
        return key

    async def revoke(self, hs: HeadscaleClient, location: tuple[str, str | None], stored: AuthKey) -> None:
        """Expire the CR's keys, delete the nodes registered with them (or recorded as the CR's after
        their key was retired) and forget the record."""
        await self.keys.expire(hs, stored)
        ids = {stored.id, stored.previous_id} - {""}
        for node in await hs.list_nodes():
            if node.pre_auth_key_id in ids or node.id in stored.node_ids:
                await hs.delete_node(node.id)
        with contextlib.suppress(NotFound):
            await self.writer.delete(SECRET, *location)

    # -- status ---------------------------------------------------------------------------------

    @staticmethod
    def tag_owned(tag: str) -> Cond:
        return Cond("TagOwned", "True", "TagOwned", f"the live policy owns {tag}")

    @classmethod
    def key_conditions(cls, key: AuthKey, tag: str) -> list[Cond]:
        return [cls.tag_owned(tag),
                Cond("PreAuthKeyValid", "True", "KeyValid",
                     f"pre-auth key {key.prefix} valid until {key.expires_at.isoformat()}")]

    async def write(self, obj: JSON, conds: list[Cond], fields: JSON | None = None, *,
                    keep: tuple[str, ...] = ()) -> None:
        await self.status.write(self.resource, obj, conds, fields, keep=keep)

    async def stop(self, obj: JSON, stop: NotReady) -> Result:
        """Report why the CR is not ready, keeping its other conditions."""
        await self.write(obj, stop.conditions, keep=self.condition_types)
        if stop.warning:
            await self.events.warning(obj, stop.reason, stop.message, action="Admit")
        return Result() if stop.requeue_after is None else Result(requeue_after=stop.requeue_after)

    def until(self, moment: datetime) -> float:
        return (moment - self.clock.utcnow()).total_seconds()

    def next_look(self, key: AuthKey) -> Result:
        """The resync period, or sooner when the key's rotation is due."""
        return Result(requeue_after=min(periods.AGENT_RESYNC, max(1.0, self.until(key.rotation_due))))

    # -- deletion -------------------------------------------------------------------------------

    def tailnet_connection(self, obj: JSON) -> Connection:
        """The working connection of the Tailnet a CR being deleted names (NoAccess when gone)."""
        tailnet = self.reader.get(Tailnet, (obj.get("spec") or {}).get("tailnetRef", {}).get("name", ""))
        if tailnet is None:
            raise NoAccess("the Tailnet is gone")
        return self.access.working(tailnet)

    async def finalize_key(self, obj: JSON, location: tuple[str, str | None]) -> Result:
        """Expire the key of a CR being deleted, then let it go; a key record the CR does not
        own (garbage collection would leave it) is deleted here."""
        if not finalizer.holds(obj):
            return Result()
        secret = self.reader.get(SECRET, *location)
        if (stored := AuthKey.from_secret(secret)) is not None:
            again = await self.cleanup.run(
                obj, lambda: self._expire(obj, stored), what=f"pre-auth key {stored.prefix}",
                reason="PreAuthKeyNotExpired",
                hint="expire it by hand (headscale preauthkeys expire), or let the orphan sweep do it")
            if again is not None:
                return again
        if secret is not None and not owned_by(secret, str(obj["metadata"]["uid"])):
            with contextlib.suppress(NotFound):
                await self.writer.delete(SECRET, *location)
        await finalizer.release(self.writer, self.resource, obj)
        return Result()

    async def _expire(self, obj: JSON, stored: AuthKey) -> None:
        async with self.access.open(self.tailnet_connection(obj)) as hs:
            await self.keys.expire(hs, stored)
        await self.events.normal(obj, "PreAuthKeyExpired", f"expired pre-auth key {stored.prefix}",
                                 action="Expire")


class TaggedNodeReconciler(Generic[CR]):
    """Reconciles the CRs of ``kind`` through the phases above, writing as the kind's field manager."""

    def __init__(self, deps: Deps, writer: Writer, kind: TaggedNode[CR]) -> None:
        self.kind = kind
        self.phases: Phases[CR] = Phases(deps, writer, kind.resource, kind.model, field_manager=kind.field_manager,
                                         condition_types=kind.condition_types)
        self.applier = Applier(deps.reader, writer, field_manager=kind.field_manager)

    async def reconcile(self, request: Request) -> Result:
        if not self.kind.accepts(request) or (obj := self.phases.load(request)) is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self.phases.finalize_key(obj, self.kind.key_location(obj))
        try:
            return await self._reconcile(obj)
        except NotReady as stop:
            return await self.phases.stop(obj, stop)

    async def _reconcile(self, obj: JSON) -> Result:
        kind, phases = self.kind, self.phases
        run = phases.parse(obj, kind.tailnet_name)
        if problem := kind.spec_problem(run):
            raise NotReady("False", *problem, requeue_after=None)
        await phases.hold_finalizer(obj)
        location = kind.key_location(obj)
        stored = phases.stored_key(location)
        if stored is None and (refusal := kind.refusal(run, None)) is not None:
            raise NotReady.refused(refusal)  # nothing to revoke: not even the live policy is read
        tag = kind.tag(run.cr)
        async with phases.headscale(phases.connection(run.tailnet)) as hs:
            live, _ = await hs.get_policy()
            if (refusal := kind.refusal(run, live)) is not None:
                if stored is not None:
                    await phases.revoke(hs, location, stored)
                raise NotReady.refused(refusal)
            phases.check_tag(live, kind.derived(run.cr), tag)
            try:
                await self.applier.apply(obj, kind.before_key(run))
                key = await phases.ensure_key(hs, obj, location, kind.key_metadata(run), run.tailnet, tag)
                nodes = await hs.list_nodes()
                applied = await self.applier.apply(obj, kind.desired(run, key))
            except Forbidden as exc:
                raise NotReady("False", "NamespaceNotGranted", kind.not_granted(run, exc)) from None
            conds, fields = await kind.report(run, Outcome(key, live, nodes, applied, hs))
        await phases.write(obj, [*phases.key_conditions(key, tag), *conds], {"preAuthKey": key.status(), **fields})
        return phases.next_look(key)


def node_status(agent: JSON | None) -> JSON | None:
    """``status.node`` from the agent's ``/status`` (None before it has a node id)."""
    node = (agent or {}).get("node")
    if not isinstance(node, dict) or not node.get("id"):
        return None
    return {"id": str(node["id"]), "name": str(node.get("name") or ""),
            "addresses": [str(a) for a in node.get("addresses") or []]}
