"""The Policy reconciler: renders and applies the tailnet policy, and owns TailnetSite status.

One reconcile per Tailnet:

* Without ``spec.policy`` it only reads the live policy and reports, in ``status.policy``, what
  the CRs need and the policy lacks, as a snippet a person can paste.
* With it, it parses the base HuJSON, appends what the CRs derive (base wins, nothing removed)
  by inserting them into the base's own text (its comments and layout kept, each entry under a
  ``// tailnet-operator: derived from ...`` comment), publishes the render in the ConfigMap
  ``<tailnet>-policy`` and, in Apply mode, writes it when the live policy differs (compared as
  data: comments and layout alone never cause a write). Headscale checks the document
  (including the base's own ``tests``) before storing it, so a rejected render never becomes
  active; its message goes to status.
* A Headscale older than 0.29 has no grants: the derived grants are rendered as equivalent
  ``acls`` entries and PolicyApplied says so (reason AppliedWithoutGrants); a base with a
  ``grants`` block of its own is not written at all (reason GrantsUnsupported, with what to do).
* Once the live policy equals the render, routes a site router advertised before its approver
  existed are approved (added to the router's approved routes, never removing any), from the
  rendered policy only: a route is approved for a router's tag only when a CR asked for it and the
  render's ``autoApprovers`` grant it to that tag, so a route the base assigns to other approvers
  ("base wins") is never approved on the CR's router.
* Every derived entry the render leaves out (the base wins, or adding it would change what the
  base allows) is listed in ``status.policy.skipped`` with the reason and the CRs it came from, is
  counted in the PolicyApplied message, and is reported by one Warning Event
  ``DerivedEntriesSkipped`` each time the set of left-out entries changes.
* Without ``spec.policy``, and in Render mode, Headscale is only read: nothing is written to it.
* TailnetEgresses count only in the operator's namespace: one elsewhere could otherwise write
  grants for its tag into the tailnet policy. Such an object is skipped, with one log line and
  one Warning Event (on its Tailnet, in the Events namespace the operator already writes to).
* Every TailnetSite of the Tailnet gets Blocked / Advertised / Approved / Ready from the
  overlap verdicts and Headscale's view of the routers that carry the site's tag.

Status is written with its own field manager (``tailnet-operator-policy``), so the fields it
owns on the Tailnet (``status.policy`` and the PolicyApplied condition) and the Tailnet
reconciler's fields never overwrite each other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from tailnet_operator import tenancy
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.site import TailnetSite
from tailnet_operator.api.tailnet import PolicyConfigMapRef, Tailnet
from tailnet_operator.headscale import HeadscaleClient, HeadscaleError, Node, PolicyRejected
from tailnet_operator.names import policy_config_map_name
from tailnet_operator.policy import (
    Derived,
    PolicyParseError,
    Rendered,
    Replay,
    SiteRoutes,
    Skipped,
    Verdict,
    diff_needed,
    has_tests,
    judge,
    missing,
    render,
)
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.cache import ParsedPolicies
from tailnet_operator.resources import ingressclass as ic
from tailnet_operator.resources import loadbalancer as lb
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime import CONFIG_MAP, SERVICE, Reader, Request, Resource, Result, Writer
from tailnet_operator.types import JSON

from . import periods
from .access import Deps, NoAccess, TailnetRun, live_tailnet, name_of
from .conditions import Cond
from .gatewayapi_plans import Plans
from .kinds import INGRESS, INGRESS_CLASS, TAILNET, TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_INGRESS, TAILNET_SITE
from .status import StatusWriter

log = structlog.get_logger("controllers.policy")

M = TypeVar("M", bound=BaseModel)

FIELD_MANAGER = "tailnet-operator-policy"
RESYNC_SECONDS = periods.POLICY_RESYNC
POLICY_KEY = "policy.hujson"
TAILNET_INDEX = "tailnetRef"
CLASS_INDEX = "ingressClassName"
"""Ingresses by ``spec.ingressClassName`` ("" for those without a class): an Ingress names its
Tailnet through its class (:func:`ingresses_of_classes`)."""
SKIPPED_IN_STATUS = 64
"""At most this many left-out entries are listed in ``status.policy.skipped`` (the schema's bound)."""


INDEXED = (TAILNET_SITE, TAILNET_EGRESS, TAILNET_INGRESS, TAILNET_GATEWAY, SERVICE)
"""What the cache indexes by :func:`tailnet_ref_index` (as :data:`TAILNET_INDEX`)."""


def tailnet_ref_index(obj: JSON) -> list[str]:
    """Index CRs by the Tailnet they name (``spec.tailnetRef``), and Services by the Tailnet of their
    LoadBalancer class, so one Tailnet's objects are one lookup."""
    name = (obj.get("spec") or {}).get("tailnetRef", {}).get("name") or lb.tailnet_of(obj)
    return [str(name)] if name else []


def class_index(obj: JSON) -> list[str]:
    """:data:`CLASS_INDEX` of an Ingress."""
    return [str((obj.get("spec") or {}).get("ingressClassName") or "")]


def ingresses_of_classes(reader: Reader, classes: list[JSON]) -> list[JSON]:
    """The Ingresses that name one of the IngressClasses ``classes``, and those without a class when
    one of them is marked default (whether it is the cluster's one default is
    :func:`~tailnet_operator.resources.ingressclass.class_of`'s to say)."""
    names = [str(c["metadata"]["name"]) for c in classes]
    if any(((c.get("metadata") or {}).get("annotations") or {}).get(ic.DEFAULT_CLASS_ANNOTATION) == "true"
           for c in classes):
        names.append("")
    return [i for name in dict.fromkeys(names) for i in reader.list(INGRESS, index=(CLASS_INDEX, name))]


def rendered_config_map_name(tailnet: str) -> str:
    return policy_config_map_name(tailnet)


@dataclass(frozen=True)
class Inputs:
    derived: Derived
    sites: list[TailnetSite]
    verdicts: dict[str, Verdict]


@dataclass(frozen=True)
class Run(TailnetRun):
    """One reconcile of one Tailnet's policy, and what its CRs need."""

    inputs: Inputs


Step = Literal["unsupported", "render-only", "in-sync", "stored-differently", "write", "written"]
"""Where a render stands: "write" is the decision to write it, "written" the write that stuck; every
other value writes nothing to Headscale."""


@dataclass(frozen=True)
class _Base:
    """The base policy as read from its ConfigMap: its ``text``, the parsed ``document``, and ``where``
    it came from (for messages)."""

    text: str
    document: JSON
    where: str


@dataclass(frozen=True)
class _Summary:
    """What status says about a render, whatever becomes of it."""

    hash: str
    server: str
    """Headscale's version label, for messages."""
    config_map: str
    policy_status: JSON
    """``status.policy`` before the outcome adds ``appliedHash``."""
    skipped_note: str
    """Appended to messages when derived entries were left out; empty otherwise."""
    applied_reason: str
    note: str
    """Appended to the Applied message: the skipped note, and the acls fallback when it was used."""

    @classmethod
    def of(cls, rendered: Rendered, server: str, tailnet: str) -> _Summary:
        config_map = rendered_config_map_name(tailnet)
        policy_status: JSON = {"renderedHash": rendered.hash, "renderedConfigMap": config_map}
        skipped_note = ""
        if rendered.skipped:
            policy_status["skipped"] = [_skipped_status(s) for s in rendered.skipped[:SKIPPED_IN_STATUS]]
            count = len(rendered.skipped)
            skipped_note = (f"; {count} derived {'entry was' if count == 1 else 'entries were'} left out "
                            "(see status.policy.skipped)")
        applied_reason, note = "Applied", skipped_note
        if rendered.grants_as_acls:
            applied_reason = "AppliedWithoutGrants"
            note = (f"; Headscale {server} has no grants (0.29+), so the {len(rendered.added.grants)} "
                    "derived grant(s) were written as equivalent acls entries (upgrade Headscale to 0.29+ for grants)"
                    f"{skipped_note}")
        return cls(rendered.hash, server, config_map, policy_status, skipped_note, applied_reason, note)


def _unwritten_condition(summary: _Summary, outcome: Step, namespace: str) -> Cond:
    """The PolicyApplied condition of an outcome that wrote nothing (``namespace``: where the render is)."""
    digest = summary.hash[:12]
    if outcome == "unsupported":
        return Cond("PolicyApplied", "False", "GrantsUnsupported",
                    f"Headscale {summary.server} does not understand the base policy's grants (Headscale 0.29+); "
                    "nothing was written. Rewrite the base's grants as acls entries, or upgrade Headscale to "
                    "0.29 or newer")
    if outcome == "render-only":
        return Cond("PolicyApplied", "False", "RenderOnly",
                    f"mode Render: the render is in ConfigMap {namespace}/{summary.config_map}; "
                    f"set spec.policy.mode to Apply to write it to Headscale{summary.skipped_note}")
    if outcome == "in-sync":
        return Cond("PolicyApplied", "True", summary.applied_reason,
                    f"the live policy equals the render {digest}{summary.note}")
    return Cond("PolicyApplied", "False", "StoredDifferently",
                f"Headscale accepted the render {digest} but what it stores differs from it (read back after "
                "the write); it is not written again until the render or the live policy changes. Compare "
                "`headscale policy get` with the rendered ConfigMap")


def _status_fields(run: Run, summary: _Summary, outcome: Step) -> JSON:
    """``status.policy`` for an outcome that wrote nothing: the render applied when the live policy
    equals it, the hash applied before when a write did not stick."""
    if outcome == "in-sync":
        return {**summary.policy_status, "appliedHash": summary.hash}
    if outcome == "stored-differently":
        return _keep_applied_hash(run, summary.policy_status)
    return dict(summary.policy_status)


def _keep_applied_hash(run: Run, policy_status: JSON) -> JSON:
    """``policy_status`` with the ``appliedHash`` status already has: the live policy is still that one."""
    previous = ((run.obj.get("status") or {}).get("policy") or {}).get("appliedHash")
    return {**policy_status, "appliedHash": previous} if previous else dict(policy_status)


class _InputReader:
    """Reads one Tailnet's CRs from the cache, and what they derive for the policy.

    Keeps the parsed CRs by (uid, resourceVersion), so a reconcile validates only the objects that
    changed. TailnetEgresses count only in the operator's ``namespace``.
    """

    def __init__(self, reader: Reader, namespace: str) -> None:
        self.reader, self.namespace = reader, namespace
        self._models: dict[tuple[str, str], BaseModel] = {}
        """Parsed CRs by (uid, resourceVersion): a reconcile validates only the objects that changed."""

    def mine(self, resource: Resource, name: str) -> list[JSON]:
        """The objects of ``resource`` that name the Tailnet ``name`` and are not being deleted."""
        return [o for o in self.reader.list(resource, index=(TAILNET_INDEX, name))
                if not o["metadata"].get("deletionTimestamp")]

    def of(self, tailnet: Tailnet) -> Inputs:
        """The Tailnet's CRs, parsed, the sites' overlap verdicts, and what the CRs derive."""
        name = name_of(tailnet)
        seen: set[tuple[str, str]] = set()
        sites = self._parsed(TailnetSite, self.mine(TAILNET_SITE, name), seen)
        verdicts = judge([SiteRoutes(name_of(s), _created(getattr(s.metadata, 'creationTimestamp', '')),
                                     tuple(str(r) for r in s.spec.routes)) for s in sites],
                         [str(r) for r in tailnet.spec.reserved_networks or []])
        egresses = self._parsed(TailnetEgress, [e for e in self.mine(TAILNET_EGRESS, name)
                                                if e["metadata"].get("namespace") == self.namespace], seen)
        gateways = self._parsed(TailnetGateway, self.mine(TAILNET_GATEWAY, name), seen)
        # An ingress enters the policy only with a tag its namespace may use (tailnet_operator.tenancy).
        platform = {e.spec.tag for e in egresses} | {g.spec.tag for g in gateways} | {s.spec.router_tag for s in sites}
        # A Service of the Tailnet's LoadBalancer class is served as an ingress (its tag owned alike).
        services = [lb.as_ingress(s) for s in self._parsed(lb.LoadBalancerService, self.mine(SERVICE, name), seen)
                    if lb.problem(s) is None]
        # So is an Ingress of one of its IngressClasses.
        classes = self.reader.list(INGRESS_CLASS)
        classed = [o for o in ingresses_of_classes(self.reader, [c for c in classes if ic.tailnet_of_class(c) == name])
                   if ic.tailnet_of(o, classes) == name and not o["metadata"].get("deletionTimestamp")]
        shapes = []
        for obj in self._parsed(ic.IngressObject, classed, seen):
            with contextlib.suppress(ic.Problem):
                shapes.append(ic.as_ingress(obj, name, self._ports(obj.namespace)))
        # And a Gateway of one of its GatewayClasses, with its routes.
        shapes += [plan.ingress for plan in Plans(self.reader).served(name) if plan.ingress is not None]
        ingresses = [i for i in [*self._parsed(TailnetIngress, self.mine(TAILNET_INGRESS, name), seen), *services,
                                 *shapes]
                     if tenancy.judge(i, tailnet, reserved=platform, names=()) is None]
        if len(self._models) > 2 * len(seen) + 64:
            self._models = {k: v for k, v in self._models.items() if k in seen}
        derived = derive_from_objects(
            egresses=egresses, ingresses=ingresses, gateways=gateways,
            sites=[s for s in sites if not verdicts[name_of(s)].blocked],
            shared_address_holders=tenancy.shared_address_holders(ingresses))
        return Inputs(derived, sites, verdicts)

    def _ports(self, namespace: str) -> ic.PortOf:
        return ic.ports_of(lambda service: self.reader.get(SERVICE, service, namespace))

    def _parsed(self, model: type[M], objects: list[JSON], seen: set[tuple[str, str]]) -> list[M]:
        """:func:`_parsed`, validating only the objects not seen at this resourceVersion before."""
        out: list[M] = []
        for obj in objects:
            meta = obj["metadata"]
            key = (str(meta.get("uid") or meta.get("name")), str(meta.get("resourceVersion") or ""))
            hit = self._models.get(key) if key[1] else None
            if isinstance(hit, model):
                out.append(hit)
            else:
                parsed = _parsed(model, [obj])
                if parsed and key[1]:
                    self._models[key] = parsed[0]
                out += parsed
            seen.add(key)
        return out


class _SiteStatus:
    """Writes each TailnetSite's status from its overlap verdict and the routers Headscale lists."""

    def __init__(self, reader: Reader, status: StatusWriter) -> None:
        self.reader, self.status = reader, status

    async def write(self, inputs: Inputs, *, nodes: list[Node] | None) -> None:
        """Blocked / Advertised / Approved / Ready of every site; ``nodes`` None when Headscale cannot be read."""
        for site in inputs.sites:
            verdict = inputs.verdicts[name_of(site)]
            routes = [str(r) for r in site.spec.routes]
            fields: dict[str, Any] = {}
            conds: list[Cond]
            if verdict.blocked:
                fields["blockedBy"] = verdict.blocked_by
                conds = [Cond("Blocked", "True", "RoutesOverlap", verdict.message),
                         Cond("Ready", "False", "Blocked", verdict.message)]
            elif nodes is None:
                conds = [Cond("Blocked", "False", "NoOverlap", "no overlap with reserved networks or older sites"),
                         Cond("Ready", "Unknown", "HeadscaleUnavailable", "the routers' state cannot be read")]
            else:
                routers = [n for n in nodes if str(site.spec.router_tag) in n.tags]
                fields["routers"] = [
                    {"node": n.name, "advertised": sorted(set(n.available_routes) & set(routes)),
                     "approved": sorted(set(n.approved_routes) & set(routes))} for n in routers]
                conds = [Cond("Blocked", "False", "NoOverlap", "no overlap with reserved networks or older sites"),
                         *_route_conditions(str(site.spec.router_tag), routes, routers)]
            raw = self.reader.get(TAILNET_SITE, name_of(site))
            if raw is not None:
                await self.status.write(TAILNET_SITE, raw, conds, fields, keep=("Advertised", "Approved"))


class PolicyReconciler:
    """Reconciles one Tailnet's policy and the status of its TailnetSites.

    Works with ``deps`` (Headscale is reached with the working key the Tailnet reconciler keeps)
    and writes through ``writer`` as :data:`FIELD_MANAGER`.
    """

    def __init__(self, deps: Deps, writer: Writer) -> None:
        self.reader, self.access, self.events, self.clock = deps.reader, deps.access, deps.events, deps.clock
        self.writer = writer
        self.status = StatusWriter(writer, deps.clock, field_manager=FIELD_MANAGER)
        self._ignored: set[str] = set()
        """uids of TailnetEgresses outside the operator's namespace already reported."""
        self._policies = ParsedPolicies()
        """Parsed base and live policies: the base by its ConfigMap's uid and resourceVersion, the
        live text by itself (the render written last is remembered, so reading it back is free)."""
        self._stored_differently: dict[str, tuple[str, str]] = {}
        """Tailnet -> (render hash, the text Headscale stored instead) of a write that did not stick."""
        self._inputs = _InputReader(deps.reader, deps.access.namespace)
        self._sites = _SiteStatus(deps.reader, self.status)
        self._skips_reported: dict[str, frozenset[Skipped]] = {}
        """Tailnet -> the left-out entries its last DerivedEntriesSkipped Event reported."""

    @property
    def namespace(self) -> str:
        return self.access.namespace

    async def reconcile(self, request: Request) -> Result:
        live = live_tailnet(self.reader, request.name)
        if live is None:
            return Result()
        obj, tailnet = live.obj, live.tailnet
        run = Run(obj, tailnet, self._inputs.of(tailnet))
        await self._report_foreign_egresses(obj, request.name)
        try:
            connection = self.access.working(tailnet)
        except NoAccess as exc:
            await self._tailnet_status(run, Cond("PolicyApplied", "Unknown", "WaitingForAccess", str(exc)))
            await self._sites.write(run.inputs, nodes=None)
            return Result(requeue_after=RESYNC_SECONDS)
        try:
            async with self.access.open(connection) as hs:
                nodes = await hs.list_nodes()
                live_text, _ = await hs.get_policy()
                if tailnet.spec.policy is None:
                    # read-only: the policy is not the operator's, so nothing is written to Headscale
                    await self._report_missing(run, live_text)
                elif (applied := await self._render_and_apply(run, live_text, hs)) is not None:
                    nodes = await self._replay_approvals(run, hs, nodes, applied)
        except HeadscaleError as exc:
            await self._tailnet_status(run, Cond("PolicyApplied", "Unknown", "HeadscaleUnavailable",
                                                 f"cannot read or write the policy: {exc}"))
            await self._sites.write(run.inputs, nodes=None)
            return Result(requeue_after=RESYNC_SECONDS)
        await self._sites.write(run.inputs, nodes=nodes)
        return Result(requeue_after=RESYNC_SECONDS)

    async def _report_foreign_egresses(self, tailnet: JSON, name: str) -> None:
        """Log and record, once per object, each TailnetEgress outside the operator's namespace.

        The Event goes on the Tailnet: its namespace is one the operator already writes Events
        to, so honouring a tenant's object is never a reason to write into the tenant's namespace.
        """
        for egress in self._inputs.mine(TAILNET_EGRESS, name):
            meta = egress["metadata"]
            if meta.get("namespace") == self.namespace or meta.get("uid") in self._ignored:
                continue
            self._ignored.add(str(meta.get("uid")))
            where = f"{meta.get('namespace')}/{meta['name']}"
            log.warning("ignoring a TailnetEgress outside the operator namespace", egress=where,
                        operator_namespace=self.namespace)
            await self.events.warning(
                tailnet, "EgressIgnored",
                f"TailnetEgress {where} is ignored: TailnetEgress is honoured only in the operator namespace "
                f"{self.namespace}; its tag is not rendered into the policy", action="Ignore")

    # -- policy -------------------------------------------------------------------------------

    async def _report_missing(self, run: Run, live_text: str) -> None:
        try:
            live = self._policies.parse(live_text, source="the live policy") if live_text.strip() else {}
        except PolicyParseError as exc:
            await self._tailnet_status(run, Cond("PolicyApplied", "Unknown", "LivePolicyUnreadable", str(exc)))
            return
        gap = missing(live, run.inputs.derived)
        policy_status: dict[str, Any] = {}
        if gap.snippet:
            policy_status["missing"] = gap.snippet
        if gap.tags:
            policy_status["missingTags"] = list(gap.tags)
        cond = (Cond("PolicyApplied", "False", "PolicyIncomplete",
                     "the live policy lacks entries the CRs need (see status.policy.missing); the operator does not "
                     "own the policy because spec.policy is not set")
                if gap.snippet else
                Cond("PolicyApplied", "True", "NothingMissing", "the live policy has every entry the CRs need"))
        await self._tailnet_status(run, cond, policy_status)

    async def _render_and_apply(self, run: Run, live_text: str, hs: HeadscaleClient) -> Rendered | None:
        """Render, publish and (in Apply mode) write; the render when the live policy equals it, else None.

        Three steps: decide what the render calls for, write it when that is the decision, report
        the outcome. Only Apply mode writes to Headscale; every other way out has only read it."""
        spec = run.tailnet.spec.policy
        assert spec is not None
        base = await self._read_base(run, spec.base_config_map_ref)
        if base is None:
            return None
        features = await hs.features()
        rendered = render(base.document, run.inputs.derived, memo=self._policies.memo(base.document),
                          grants=features.grants, text=base.text)
        await self._publish(run, rendered.text, rendered.hash)
        await self._report_skipped(run, rendered.skipped, base.where)
        step = self._decide(run, rendered, live_text, apply=spec.mode == "Apply")
        outcome = await self._write(run, rendered, hs) if step == "write" else step
        await self._report(run, _Summary.of(rendered, features.label, run.name), outcome)
        return rendered if outcome in ("in-sync", "written") else None

    async def _read_base(self, run: Run, ref: PolicyConfigMapRef) -> _Base | None:
        """The base policy from its ConfigMap; None, with status saying why, when it is missing or invalid."""
        base_cm = self.reader.get(CONFIG_MAP, ref.name, ref.namespace)
        if base_cm is None or ref.key not in (base_cm.get("data") or {}):
            what = "does not exist" if base_cm is None else f"has no key {ref.key}"
            await self._tailnet_status(run, Cond(
                "PolicyApplied", "False", "BasePolicyMissing",
                f"the base policy ConfigMap {ref.namespace}/{ref.name} {what}; nothing was rendered or written"))
            return None
        text = base_cm["data"][ref.key]
        where = f"ConfigMap {ref.namespace}/{ref.name}"
        try:
            meta = base_cm["metadata"]
            document = self._policies.parse(text, source=where,
                                            version=f"{meta.get('uid')}/{meta.get('resourceVersion')}/{ref.key}")
        except PolicyParseError as exc:
            await self._tailnet_status(run, Cond("PolicyApplied", "False", "BasePolicyInvalid", str(exc)))
            return None
        return _Base(text, document, where)

    def _decide(self, run: Run, rendered: Rendered, live_text: str, *, apply: bool) -> Step:
        """What the render calls for, without touching Headscale: a write only in Apply mode, when the
        server understands the render, the live policy differs, and the same write did not already
        come back stored differently (writing it again would only add a row)."""
        if rendered.unsupported:
            return "unsupported"
        if not apply:
            return "render-only"
        if live_text.strip() and not diff_needed(live_text, rendered, parsed=self._policies):
            return "in-sync"
        if self._stored_differently.get(run.name) == (rendered.hash, live_text):
            return "stored-differently"
        return "write"

    async def _write(self, run: Run, rendered: Rendered, hs: HeadscaleClient) -> Step | PolicyRejected:
        """Check (when the render has tests), write and read back the render: "written",
        "stored-differently" (Headscale keeps a policy that means something else), or Headscale's
        refusal."""
        try:
            if has_tests(rendered.document):
                await hs.check_policy(rendered.text)
            await hs.set_policy(rendered.text)
            stored, _ = await hs.get_policy()
            if diff_needed(stored, rendered, parsed=self._policies):
                self._stored_differently[run.name] = (rendered.hash, stored)
                await self.events.warning(run.obj, "PolicyStoredDifferently",
                                          f"Headscale accepted the rendered policy {rendered.hash[:12]} but stores a "
                                          "policy that means something else", action="ApplyPolicy")
                return "stored-differently"
            self._stored_differently.pop(run.name, None)
            self._policies.remember(rendered.text, rendered.document, source="live policy")
        except PolicyRejected as exc:
            return exc
        return "written"

    async def _report(self, run: Run, summary: _Summary, outcome: Step | PolicyRejected) -> None:
        """The PolicyApplied condition and ``status.policy`` for the outcome, and its Events."""
        digest, policy_status = summary.hash[:12], summary.policy_status
        if isinstance(outcome, PolicyRejected):
            await self._tailnet_status(run, Cond(
                "PolicyApplied", "False", "PolicyRejected",
                f"Headscale refused the render {digest}; the live policy is unchanged: {outcome.message}"),
                _keep_applied_hash(run, policy_status))
            await self.events.warning(run.obj, "PolicyRejected",
                                      f"Headscale refused the rendered policy: {outcome.message}", action="ApplyPolicy")
        elif outcome == "written":
            await self.events.normal(run.obj, "PolicyApplied", f"wrote the rendered policy {digest} to Headscale",
                                     action="ApplyPolicy")
            await self._tailnet_status(run, Cond("PolicyApplied", "True", summary.applied_reason,
                                                 f"wrote the render {digest} to Headscale{summary.note}"),
                                       {**policy_status, "appliedHash": summary.hash})
        else:
            await self._tailnet_status(run, _unwritten_condition(summary, outcome, self.namespace),
                                       _status_fields(run, summary, outcome))

    async def _report_skipped(self, run: Run, skipped: tuple[Skipped, ...], base: str) -> None:
        """One Warning Event each time the set of left-out entries changes (none when it empties)."""
        reported = frozenset(skipped)
        if self._skips_reported.get(run.name, frozenset()) == reported:
            return
        if not reported:
            self._skips_reported.pop(run.name, None)
            return
        self._skips_reported[run.name] = reported
        count = len(skipped)
        details = "; ".join(f"{s.kind} {s.entry}" + (f" ({', '.join(s.sources)})" if s.sources else "")
                            + f": {s.reason}" for s in skipped)
        log.warning("derived policy entries left out of the render", tailnet=run.name, count=count,
                    entries=[s.entry for s in skipped])
        await self.events.warning(
            run.obj, "DerivedEntriesSkipped",
            f"the render of the base policy {base} leaves out {count} derived "
            f"{'entry' if count == 1 else 'entries'} the CRs need; the operator does not apply "
            f"{'it' if count == 1 else 'them'} (a route left out is not approved): {details}",
            action="RenderPolicy")

    async def _publish(self, run: Run, text: str, digest: str) -> None:
        await self.writer.apply(CONFIG_MAP, {
            "metadata": owned_metadata(run.obj, name=rendered_config_map_name(run.name), namespace=self.namespace,
                                       tailnet=run.name, annotations={"tailnet.dev/policy-hash": digest}),
            "data": {POLICY_KEY: text},
        }, field_manager=FIELD_MANAGER)

    # -- approvals and sites ------------------------------------------------------------------

    async def _replay_approvals(self, run: Run, hs: HeadscaleClient, nodes: list[Node],
                                rendered: Rendered) -> list[Node]:
        """Approve what tagged nodes advertised before the policy approved it automatically.

        Headscale auto-approves only when a node advertises, so a site router, the gateway (its
        routes and load-balancer range) or a router of an egress host route that came up before
        its approver was rendered stays unapproved. A derived approval is replayed here only where
        the rendered policy (equal to the live one) grants it to the router's tag
        (:class:`~tailnet_operator.policy.Replay`): the base's own approvers decide its routes.
        """
        replay = Replay(rendered.document, run.inputs.derived)
        updated: list[Node] = []
        for node in nodes:
            wanted = replay.routes(node.tags, node.available_routes, node.approved_routes)
            if wanted:
                node = await hs.add_approved_routes(node, wanted)
                await self.events.normal(run.obj, "RoutesApproved",
                                         f"approved {', '.join(wanted)} on router {node.name}",
                                         action="ApproveRoutes")
            updated.append(node)
        return updated

    async def _tailnet_status(self, run: Run, cond: Cond, policy: JSON | None = None) -> None:
        """Apply ``status.policy`` (kept as it was when ``policy`` is None) and the PolicyApplied condition."""
        if policy is None:
            policy = (run.obj.get("status") or {}).get("policy")
        await self.status.write(TAILNET, run.obj, [cond], {"policy": policy} if policy else None,
                                observed_generation=False)


def _parsed(model: type[M], objects: list[JSON]) -> list[M]:
    """Objects that parse; one that does not (the schema should have refused it) is skipped and logged,
    so it cannot stop the rest of the Tailnet's policy."""
    parsed = []
    for obj in objects:
        try:
            parsed.append(model.model_validate(obj))
        except ValidationError as exc:
            log.warning("skipping an object that does not parse", kind=obj.get("kind"),
                        name=obj["metadata"].get("name"), error=str(exc).splitlines()[0])
    return parsed


def _skipped_status(skipped: Skipped) -> JSON:
    """A ``status.policy.skipped`` item, cut to the schema's bounds."""
    item: JSON = {"kind": skipped.kind, "entry": skipped.entry[:1024], "reason": skipped.reason[:2048]}
    if skipped.sources:
        item["sources"] = [source[:253] for source in skipped.sources[:16]]
    return item


def _route_conditions(tag: str, routes: list[str], routers: list[Node]) -> list[Cond]:
    advertised = {r for n in routers for r in n.available_routes}
    approved = {r for n in routers for r in n.approved_routes}
    not_advertised = [r for r in routes if r not in advertised]
    not_approved = [r for r in routes if r not in approved]
    if not routers:
        adv = Cond("Advertised", "False", "NoRouter", f"no node carries the router tag {tag}")
    elif not_advertised:
        adv = Cond("Advertised", "False", "NotAdvertised",
                   f"no router with {tag} advertises {', '.join(not_advertised)}")
    else:
        adv = Cond("Advertised", "True", "Advertised", f"{len(routers)} router(s) with {tag} advertise every route")
    if not_approved:
        appr = Cond("Approved", "False", "NotApproved", f"not approved on any router: {', '.join(not_approved)}")
    else:
        appr = Cond("Approved", "True", "Approved", "every route is approved on a router")
    ready = (Cond("Ready", "True", "Routed", "every route is advertised and approved")
             if adv.status == "True" and appr.status == "True"
             else Cond("Ready", "False", adv.reason if adv.status != "True" else appr.reason,
                       adv.message if adv.status != "True" else appr.message))
    return [adv, appr, ready]


def _created(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value or "")
