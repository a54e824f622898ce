"""The orphan sweep: what the operator made in Headscale for CRs that no longer exist goes.

A finalizer expires a CR's key when the CR is deleted, but a finalizer can be skipped
(``tailnet.dev/skip-cleanup``), give up (Headscale unreachable for its whole bound), or a crash can
leave a key that was created and never recorded. This controller, one reconcile per Tailnet every
:data:`SWEEP_SECONDS` (controllers run only on the leader), lists the Tailnet's Headscale and
expires the pre-auth keys, and deletes the ephemeral nodes, that carry this installation's marker
(:func:`~tailnet_operator.headscale.installation_tag` of the Tailnet's uid) and that none of this
installation's CRs refers to (:func:`~tailnet_operator.headscale.orphans_of` has the rule); and
deletes the installation's ephemeral nodes offline for longer than ``stale_after``
(:func:`stale_nodes`), which Headscale should have aged out.

What counts is this Tailnet's own: the TailnetEgresses of the operator's namespace (the only
ones it acts on), the TailnetIngresses and TailnetGateways that name the Tailnet, the Services of
its LoadBalancer class (``tailnet.dev/<tailnet>``, their tag from ``tailnet.dev/tag``), and the key
Secrets those CRs own (a key Secret without an owner counts unless its ``tailnet.dev/tailnet``
label names another Tailnet). Keys and nodes of another installation sharing the Headscale carry
another marker, and those made before markers were per installation carry the shared
:data:`~tailnet_operator.headscale.LEGACY_OWNER_TAG`: the sweep never touches either (see
:mod:`tailnet_operator.headscale._ownership` for what becomes of the latter). Each sweep that
found something records a Normal Event ``OrphansSwept`` on the Tailnet and counts in
``tailnet_operator_orphans_swept_total{kind}``.

:func:`references` and :func:`list_orphans` are the same check without the sweep, for tests and
tools that must prove there are no orphans.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

import structlog
from prometheus_client import CollectorRegistry, Counter

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import (
    DEFAULT_GRACE,
    HeadscaleClient,
    HeadscaleError,
    Node,
    Orphans,
    PreAuthKey,
    References,
    find_orphans,
    orphans_of,
    owned_node,
    sweep_orphans,
)
from tailnet_operator.names import TAILNET_LABEL, managed_by_operator
from tailnet_operator.resources import gatewayapi, ingressclass, loadbalancer
from tailnet_operator.runtime import SECRET, SERVICE, Reader, Request, Result
from tailnet_operator.types import JSON

from . import periods
from .access import Deps, NoAccess, Problem
from .keyrecord import KEY_ID, KEY_TAG, PREVIOUS_KEY_ID
from .kinds import (
    API_GATEWAY,
    GATEWAY_CLASS,
    INGRESS,
    INGRESS_CLASS,
    TAILNET,
    TAILNET_EGRESS,
    TAILNET_GATEWAY,
    TAILNET_INGRESS,
)

__all__ = ["STALE_AFTER", "SWEEP_SECONDS", "OrphanSweeper", "SweepMetrics", "installation_crs", "list_orphans",
           "references", "references_from", "stale_nodes"]

log = structlog.get_logger("controllers.sweep")

SWEEP_SECONDS = periods.SWEEP_EVERY
STALE_AFTER = dt.timedelta(hours=1)
"""How long an ephemeral node of the installation may stay offline before the sweep deletes it even
though a CR has its tag: twice Headscale's default ``ephemeral_node_inactivity_timeout`` (30 min),
so it is only what Headscale should have aged out and did not (a SIGKILL loses its expiry timers)."""
RETRY_SECONDS = periods.SWEEP_RETRY


def references(secrets: Iterable[JSON], crs: Iterable[JSON]) -> References:
    """What the CRs ``crs`` (TailnetEgress, TailnetIngress, TailnetGateway objects; those being
    deleted do not count) refer to in Headscale: the key ids recorded in the pre-auth key Secrets
    among ``secrets`` whose owner is one of them (or that name no owner: then kept, to be safe),
    and the CRs' tags. The Secrets must carry their annotations (a metadata-only informer drops
    them: see :func:`references_from`)."""
    # a CR being deleted needs its key and node no more (its finalizer expires the key, or was
    # skipped or gave up), and a cache may hold it a while after it is gone
    crs = [c for c in crs if not c["metadata"].get("deletionTimestamp")]
    uids = {str(c["metadata"].get("uid") or "") for c in crs}
    tags = {str((c.get("spec") or {}).get("tag") or "") for c in crs}
    key_ids: set[str] = set()
    for secret in secrets:
        meta = secret.get("metadata") or {}
        notes = meta.get("annotations") or {}
        if KEY_TAG not in notes:
            continue
        owners = meta.get("ownerReferences") or []
        if owners and not any(str(o.get("uid") or "") in uids for o in owners):
            continue  # its CR is gone; garbage collection removes the Secret soon
        key_ids.update(v for v in (notes.get(KEY_ID), notes.get(PREVIOUS_KEY_ID)) if v)
    return References(key_ids=frozenset(key_ids), tags=frozenset(tags - {""}))


def installation_crs(reader: Reader, tailnet: str, namespace: str) -> list[JSON]:
    """The CRs of this installation that use the Tailnet ``tailnet``: its TailnetIngresses and
    TailnetGateways, and its TailnetEgresses in the operator's ``namespace`` (one elsewhere is
    never acted on, so it cannot keep a key or node alive); and the Services of its
    LoadBalancer class, as :func:`~tailnet_operator.resources.loadbalancer.sweep_view` shows them,
    the Ingresses of its IngressClasses (:func:`~tailnet_operator.resources.ingressclass.sweep_view`)
    and the Gateways of its GatewayClasses (:func:`~tailnet_operator.resources.gatewayapi.sweep_view`)."""
    def of_tailnet(obj: JSON) -> bool:
        return bool(((obj.get("spec") or {}).get("tailnetRef") or {}).get("name") == tailnet)

    crs = [o for kind in (TAILNET_EGRESS, TAILNET_INGRESS, TAILNET_GATEWAY) for o in reader.list(kind)
           if of_tailnet(o) and (kind != TAILNET_EGRESS or o["metadata"].get("namespace") == namespace)]
    classes, gateway_classes = reader.list(INGRESS_CLASS), reader.list(GATEWAY_CLASS)
    return crs + [v for s in reader.list(SERVICE) if (v := loadbalancer.sweep_view(s, tailnet)) is not None] \
        + [v for i in reader.list(INGRESS) if (v := ingressclass.sweep_view(i, tailnet, classes)) is not None] \
        + [v for g in reader.list(API_GATEWAY) if (v := gatewayapi.sweep_view(g, tailnet, gateway_classes)) is not None]


def references_from(reader: Reader, tailnet: str, namespace: str) -> References:
    """:func:`references` over the cache, for the CRs of :func:`installation_crs`.

    Outside the operator's namespace the cache holds Secrets by metadata, without annotations: the
    candidates (owned by one of those CRs, or the operator's label and no owner) are read whole,
    one by one; a Secret labelled for another Tailnet does not count. A body not in the cache yet
    raises :class:`~tailnet_operator.runtime.cache.NotYetCached`, so no sweep runs on references it
    could not read (the controller retries once the body is in)."""
    crs = installation_crs(reader, tailnet, namespace)
    uids = {str(c["metadata"].get("uid") or "") for c in crs}
    whole = []
    for meta_only in reader.list(SECRET):
        meta = meta_only["metadata"]
        labels = meta.get("labels") or {}
        owners = meta.get("ownerReferences") or []
        labelled = (managed_by_operator(meta_only) and not owners
                    and labels.get(TAILNET_LABEL, tailnet) == tailnet)
        owned = any(str(o.get("uid") or "") in uids for o in owners)
        if labelled or owned:
            secret = reader.get(SECRET, meta["name"], meta.get("namespace"))
            if secret is not None:
                whole.append(secret)
    return references(whole, crs)


async def list_orphans(hs: HeadscaleClient, refs: References, *, now: dt.datetime | None = None,
                       grace: dt.timedelta = dt.timedelta(0), owner_tag: str | None = None) -> Orphans:
    """The installation's keys and ephemeral nodes on ``hs`` that no CR refers to (reads only);
    the installation is ``owner_tag``, by default the one the client acts for.

    ``grace`` defaults to 0 here: a check after things have settled wants every orphan."""
    return await find_orphans(hs, refs, now=now, grace=grace, owner_tag=owner_tag or hs.owner_tag)


def stale_nodes(keys: Iterable[PreAuthKey], nodes: Iterable[Node], *, owner_tag: str, now: dt.datetime,
                offline_for: dt.timedelta) -> list[Node]:
    """The installation's ephemeral nodes offline (by ``lastSeen``, else creation) for ``offline_for``
    or longer, whatever their tags: Headscale ages these out itself, unless it was killed while
    they were offline (its expiry timers live in memory; chaos runs have seen four such nodes)."""
    ephemeral = {k.id for k in keys if k.ephemeral}
    return [n for n in nodes
            if owned_node(n, owner_tag) and (n.pre_auth_key_id or "") in ephemeral and not n.online
            and (seen := n.last_seen or n.created_at) is not None and now - seen >= offline_for]


class SweepMetrics:
    """``tailnet_operator_orphans_swept_total{kind}``: pre-auth keys expired and nodes deleted by
    the sweep; ``tailnet_operator_orphan_sweeps_total{result}``: sweeps, ``ok`` or ``error``."""

    def __init__(self, *, registry: CollectorRegistry) -> None:
        self.swept = Counter("tailnet_operator_orphans_swept_total",
                             "Operator-owned Headscale objects no CR refers to that the sweep removed "
                             "(kind preauthkey: expired; kind node: deleted).", ("kind",), registry=registry)
        self.sweeps = Counter("tailnet_operator_orphan_sweeps_total",
                              "Orphan sweeps of one Tailnet's Headscale, by result (ok, error).",
                              ("result",), registry=registry)
        for kind in ("preauthkey", "node"):
            self.swept.labels(kind)
        for result in ("ok", "error"):
            self.sweeps.labels(result)


class OrphanSweeper:
    """Reconciles a Tailnet by sweeping its Headscale; requeues itself every ``interval`` seconds."""

    def __init__(self, deps: Deps, *, metrics: SweepMetrics | None = None, grace: dt.timedelta = DEFAULT_GRACE,
                 interval: float = SWEEP_SECONDS, stale_after: dt.timedelta = STALE_AFTER) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.metrics = metrics
        self.grace = grace
        """How old an unreferenced key or node must be to go (default 10 min: longer than a create-then-store)."""
        self.interval = interval
        """Seconds between sweeps of one Tailnet (default :data:`SWEEP_SECONDS`)."""
        self.stale_after = stale_after
        """How long an owned ephemeral node may be offline before it goes (default :data:`STALE_AFTER`)."""
        self.last: Orphans = Orphans()
        """What the last sweep removed (for tests and diagnostics)."""

    async def reconcile(self, request: Request) -> Result:
        obj = self.reader.get(TAILNET, request.name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return Result()
        try:
            tailnet = self.reader.get(Tailnet, request.name)
            assert tailnet is not None
            connection = self.access.working(tailnet)
        except (NoAccess, Problem, ValueError):
            return Result(requeue_after=self.interval)  # the Tailnet's own status says why
        if connection.owner_tag is None:
            return Result(requeue_after=self.interval)  # a Tailnet without a uid: nothing can be this installation's
        refs = references_from(self.reader, request.name, self.access.namespace)
        log.debug("orphan sweep", tailnet=request.name, owner_tag=connection.owner_tag,
                  referenced_keys=sorted(refs.key_ids), referenced_tags=sorted(refs.tags))
        try:
            async with self.access.open(connection) as hs:
                keys, nodes = await hs.list_preauth_keys(), await hs.list_nodes()
                now = self.clock.utcnow()
                orphans = orphans_of(keys, nodes, refs, owner_tag=connection.owner_tag, now=now, grace=self.grace)
                stale = stale_nodes(keys, nodes, owner_tag=connection.owner_tag, now=now, offline_for=self.stale_after)
                extra = tuple(n for n in stale if n.id not in {o.id for o in orphans.nodes})
                swept = await sweep_orphans(hs, Orphans(keys=orphans.keys, nodes=orphans.nodes + extra))
        except HeadscaleError as exc:
            if self.metrics is not None:
                self.metrics.sweeps.labels("error").inc()
            log.info("orphan sweep failed; retrying", tailnet=request.name, error=type(exc).__name__,
                     reason=str(exc))
            return Result(requeue_after=RETRY_SECONDS)
        self.last = swept
        if self.metrics is not None:
            self.metrics.sweeps.labels("ok").inc()
            self.metrics.swept.labels("preauthkey").inc(len(swept.keys))
            self.metrics.swept.labels("node").inc(len(swept.nodes))
        if swept:
            what = ", ".join(filter(None, (
                f"expired {len(swept.keys)} pre-auth key(s) {' '.join(k.masked_key for k in swept.keys)}"
                if swept.keys else "",
                f"deleted {len(swept.nodes)} ephemeral node(s) {' '.join(n.name or n.id for n in swept.nodes)}"
                if swept.nodes else "")))
            log.info("orphans swept", tailnet=request.name, keys=len(swept.keys), nodes=len(swept.nodes))
            await self.events.normal(obj, "OrphansSwept",
                                     f"{what}: made by the operator for CRs that no longer exist", action="Sweep")
        return Result(requeue_after=self.interval)
