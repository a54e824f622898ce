"""What the Egress, Ingress and Gateway reconcilers share: one CR, one tagged tailnet node.

Each loads and validates its CR, finds its Tailnet and the working Headscale connection, checks
the tag against the live policy before anything reaches the tailnet, keeps the node's pre-auth
key (:mod:`.preauth`) in a Secret of the operator's, writes status through one
:class:`~.status.StatusWriter`, and on deletion retries Headscale behind the finalizer, giving up
(with a Warning Event) after :data:`FINALIZE_GIVE_UP`, or at once under ``tailnet.dev/skip-cleanup``
(:mod:`.cleanup`). The kind-specific parts (which objects,
which status, what deletion removes) stay in the reconcilers.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import structlog
from pydantic import ValidationError

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleClient
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.policy import missing
from tailnet_operator.policy.derive import Derived
from tailnet_operator.runtime import (
    FINALIZER,
    SECRET,
    Request,
    Resource,
    Result,
    Writer,
    add_finalizer,
    has_finalizer,
    remove_finalizer,
)
from tailnet_operator.types import JSON

from .access import Connection, Deps, NoAccess
from .cleanup import GIVE_UP, Cleanup
from .conditions import Cond, Status
from .preauth import AuthKey, AuthKeyKeeper, Wanted
from .status import StatusWriter

__all__ = ["FINALIZE_GIVE_UP", "RETRY_SECONDS", "AgentReconciler", "node_status"]

log = structlog.get_logger("controllers.agents")

RETRY_SECONDS = 10.0
RESYNC_SECONDS = 30.0
"""The agent's view changes on its own; status is refreshed this often."""
FINALIZE_GIVE_UP = GIVE_UP
"""How long a finalizer retries Headscale before it lets the object go with a Warning Event."""


class AgentReconciler:
    """The shared half of a reconciler of ``kind``, writing as ``field_manager``."""

    kind: Resource
    model: Any
    """The pydantic model of ``kind`` (its ``spec.tailnet_ref`` names the Tailnet)."""
    condition_types: tuple[str, ...]
    """The conditions besides Ready that a not-ready status keeps as they are."""
    finalizer_first = True
    """Whether :meth:`reconcile` holds the finalizer before :meth:`reconcile_one`; a kind that
    holds it itself once it has made something (the gateway, after the tag pre-check) says False."""

    def __init__(self, deps: Deps, writer: Writer, *, field_manager: str) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.writer = writer
        self.field_manager = field_manager
        self.status = StatusWriter(writer, deps.clock, field_manager=field_manager)
        self.keys = AuthKeyKeeper(writer, deps.clock, field_manager=field_manager)
        self.cleanup = Cleanup(deps.events, deps.clock)

    def key_secret_name(self, name: str) -> str:
        """The Secret that holds the pre-auth key of the CR ``name`` (see :meth:`key_namespace`)."""
        return auth_key_secret_name(self.kind.kind, name)

    def key_namespace(self, obj: JSON) -> str | None:
        """Where the key Secret of ``obj`` lives: beside a namespaced CR by default."""
        namespace = obj["metadata"].get("namespace")
        return str(namespace) if namespace else None

    def key_location(self, obj: JSON) -> tuple[str, str | None]:
        """(name, namespace) of the Secret that records the key of ``obj``."""
        return self.key_secret_name(obj["metadata"]["name"]), self.key_namespace(obj)

    # -- the reconcile, up to the kind's own part -----------------------------------------------

    async def reconcile(self, request: Request) -> Result:
        """Load, finalize, validate, find the Tailnet and hold the finalizer; then :meth:`reconcile_one`."""
        if not self.accepts(request):
            return Result()
        obj = self.reader.get(self.kind, request.name, request.namespace or None)
        if obj is None:
            return Result()
        if obj["metadata"].get("deletionTimestamp"):
            return await self.finalize(obj)
        try:
            parsed = self.model.model_validate(obj)
        except ValidationError as exc:
            await self.not_ready(obj, "False", "InvalidSpec", str(exc).splitlines()[0])
            return Result()
        if problem := self.spec_problem(parsed):
            await self.not_ready(obj, "False", *problem)
            return Result()
        tailnet = self.reader.get(Tailnet, parsed.spec.tailnet_ref.name)
        if tailnet is None:
            await self.not_ready(obj, "False", "TailnetNotFound",
                                 f"the Tailnet {parsed.spec.tailnet_ref.name} does not exist")
            return Result(requeue_after=RESYNC_SECONDS)
        if self.finalizer_first:
            await self.hold_finalizer(obj)
        return await self.reconcile_one(obj, parsed, tailnet)

    async def hold_finalizer(self, obj: JSON) -> None:
        if not has_finalizer(obj, FINALIZER):
            await add_finalizer(self.writer, self.kind, obj, FINALIZER)

    def accepts(self, request: Request) -> bool:
        """Whether the kind is acted on in the request's namespace (all by default)."""
        return True

    def spec_problem(self, parsed: Any) -> tuple[str, str] | None:
        """(reason, message) of a spec the schema allows but this operator cannot serve."""
        return None

    async def reconcile_one(self, obj: JSON, parsed: Any, tailnet: Tailnet) -> Result:
        raise NotImplementedError

    def until(self, moment: datetime) -> float:
        return (moment - self.clock.utcnow()).total_seconds()

    async def working_connection(self, obj: JSON, tailnet: Tailnet) -> Connection | Result:
        """The Tailnet's Headscale with its working key; otherwise Ready is ``WaitingForAccess``."""
        try:
            return self.access.working(tailnet)
        except NoAccess as exc:
            await self.not_ready(obj, "Unknown", "WaitingForAccess", str(exc))
            return Result(requeue_after=RETRY_SECONDS)

    # -- tag and key ----------------------------------------------------------------------------

    @staticmethod
    def tag_gap(live: str, derived: Derived, tag: str) -> str:
        """The snippet that would make the live policy own ``tag`` ("" when it does)."""
        gap = missing(live or None, derived)
        return gap.snippet if tag in gap.tags else ""

    async def tag_not_owned(self, obj: JSON, tag: str, snippet: str) -> None:
        message = (f"the live policy does not own {tag}; nothing was created on the tailnet. "
                   f"Add this to the policy (or set spec.policy on the Tailnet to let the operator do it):\n"
                   f"{snippet}")
        await self.status.write(self.kind, obj, [
            Cond("Ready", "False", "TagNotOwned", message), Cond("TagOwned", "False", "TagNotOwned", message)],
            keep=self.condition_types)

    async def ensure_key(self, hs: HeadscaleClient, obj: JSON, metadata: JSON, tailnet: Tailnet,
                         tag: str, *, single_use: bool = False) -> AuthKey:
        """The CR's pre-auth key, created or rotated when due (a Normal Event says why): reusable
        and ephemeral for an agent, or ``single_use`` and not ephemeral (one node, which stays)."""
        secret = self.reader.get(SECRET, *self.key_location(obj))
        wanted = Wanted(login_url=str(tailnet.spec.login_url), tag=tag,
                        reusable=not single_use, ephemeral=not single_use)
        key, reason = await self.keys.ensure(hs, metadata, AuthKey.from_secret(secret), wanted)
        if reason:
            await self.events.normal(obj, "PreAuthKeyRotated", f"new pre-auth key {key.prefix} ({reason})",
                                     action="Rotate")
        return key

    @staticmethod
    def tag_owned(tag: str) -> Cond:
        return Cond("TagOwned", "True", "TagOwned", f"the live policy owns {tag}")

    @classmethod
    def key_conditions(cls, key: AuthKey, tag: str) -> list[Cond]:
        return [cls.tag_owned(tag),
                Cond("PreAuthKeyValid", "True", "KeyValid",
                     f"pre-auth key {key.prefix} valid until {key.expires_at.isoformat()}")]

    async def not_ready(self, obj: JSON, status: Status, reason: str, message: str) -> None:
        await self.status.write(self.kind, obj, [Cond("Ready", status, reason, message)],
                                keep=self.condition_types)

    # -- deletion -------------------------------------------------------------------------------

    async def finalize(self, obj: JSON) -> Result:
        """Expire the key of a CR being deleted, then let it go (bounded, or skipped: :mod:`.cleanup`)."""
        if not has_finalizer(obj, FINALIZER):
            return Result()
        stored = AuthKey.from_secret(self.reader.get(SECRET, *self.key_location(obj)))
        if stored is not None:
            again = await self.cleanup.run(
                obj, lambda: self._expire(obj, stored), what=f"pre-auth key {stored.prefix}",
                reason="PreAuthKeyNotExpired",
                hint="expire it by hand (headscale preauthkeys expire), or let the orphan sweep do it")
            if again is not None:
                return again
        await self.forget_key(obj)
        await remove_finalizer(self.writer, self.kind, obj, FINALIZER)
        return Result()

    async def forget_key(self, obj: JSON) -> None:
        """Remove what records the key of ``obj`` where garbage collection cannot (nothing by default)."""

    def tailnet_connection(self, obj: JSON) -> Connection:
        """The working connection of the Tailnet a CR being deleted names (NoAccess when gone)."""
        tailnet = self.reader.get(Tailnet, (obj.get("spec") or {}).get("tailnetRef", {}).get("name", ""))
        if tailnet is None:
            raise NoAccess("the Tailnet is gone")
        return self.access.working(tailnet)

    async def _expire(self, obj: JSON, stored: AuthKey) -> None:
        async with self.access.open(self.tailnet_connection(obj)) as hs:
            await self.keys.expire(hs, stored)
        await self.events.normal(obj, "PreAuthKeyExpired", f"expired pre-auth key {stored.prefix}",
                                 action="Expire")

    def still_trying(self, obj: JSON) -> bool:
        """Whether ``obj`` has been deleting for less than :data:`FINALIZE_GIVE_UP`."""
        return self.cleanup.still_trying(obj)


def node_status(agent: JSON | None) -> JSON | None:
    """``status.node`` from the agent's ``/status`` (None before it has a node id)."""
    node = (agent or {}).get("node")
    if not isinstance(node, dict) or not node.get("id"):
        return None
    return {"id": str(node["id"]), "name": str(node.get("name") or ""),
            "addresses": [str(a) for a in node.get("addresses") or []]}
