"""The Policy reconciler: renders and applies the tailnet policy, and owns TailnetSite status.

One reconcile per Tailnet:

* Without ``spec.policy`` it only reads the live policy and reports, in ``status.policy``, what
  the CRs need and the policy lacks, as a snippet a person can paste.
* With it, it parses the base HuJSON, appends what the CRs derive (base wins, nothing removed),
  publishes the render in the ConfigMap ``<tailnet>-policy`` and, in Apply mode, writes it when
  the live policy differs. Headscale checks the document (including the base's own ``tests``)
  before storing it, so a rejected render never becomes active; its message goes to status.
* Once the live policy equals the render, routes a site router advertised before its approver
  existed are approved (added to the router's approved routes, never removing any).
* Every TailnetSite of the Tailnet gets Blocked / Advertised / Approved / Ready from the
  overlap verdicts and Headscale's view of the routers that carry the site's tag.

Status is written with its own field manager (``tailnet-operator-policy``), so the fields it
owns on the Tailnet (``status.policy`` and the PolicyApplied condition) and the Tailnet
reconciler's fields never overwrite each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog
from pydantic import BaseModel, ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.gateway import TailnetGateway
from tailnet_operator.api.ingress import TailnetIngress
from tailnet_operator.api.site import TailnetSite
from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.headscale import HeadscaleError, Node, PolicyRejected
from tailnet_operator.policy import Derived, PolicyParseError, diff_needed, missing, parse_hujson, render
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.resources import owned_metadata
from tailnet_operator.runtime.client import JSON
from tailnet_operator.runtime.controller import Request, Result
from tailnet_operator.runtime.kinds import CONFIG_MAP

from . import conditions
from .conditions import Cond
from .kinds import TAILNET, TAILNET_EGRESS, TAILNET_GATEWAY, TAILNET_INGRESS, TAILNET_SITE
from .sites import SiteRoutes, Verdict, judge
from .tailnet import Problem, TailnetScoped

log = structlog.get_logger("controllers.policy")

M = TypeVar("M", bound=BaseModel)

FIELD_MANAGER = "tailnet-operator-policy"
RESYNC_SECONDS = 30.0
"""Routers advertise on their own schedule; site status and approvals are refreshed this often."""
POLICY_KEY = "policy.hujson"
TAILNET_INDEX = "tailnetRef"


def tailnet_ref_index(obj: JSON) -> list[str]:
    """Index CRs by the Tailnet they name, so one Tailnet's CRs are one lookup."""
    name = (obj.get("spec") or {}).get("tailnetRef", {}).get("name")
    return [str(name)] if name else []


def rendered_config_map_name(tailnet: str) -> str:
    return f"{tailnet}-policy"


class NoAccess(Exception):
    """The Tailnet reconciler has not stored a working key yet."""


@dataclass(frozen=True)
class Inputs:
    derived: Derived
    sites: list[TailnetSite]
    verdicts: dict[str, Verdict]


class PolicyReconciler(TailnetScoped):
    """Reconciles one Tailnet's policy and the status of its TailnetSites."""

    async def reconcile(self, request: Request) -> Result:
        obj = self.cache.get(TAILNET, request.name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return Result()
        try:
            tailnet = Tailnet.model_validate(obj)
        except ValidationError:
            return Result()  # the Tailnet reconciler reports InvalidSpec; nothing to render from
        inputs = self._inputs(tailnet)
        try:
            url, key, ca = self._access(tailnet)
        except NoAccess as exc:
            await self._tailnet_status(obj, {}, Cond("PolicyApplied", "Unknown", "WaitingForAccess", str(exc)))
            await self._sites_status(inputs, nodes=None)
            return Result(requeue_after=RESYNC_SECONDS)
        try:
            async with self._headscale(url, key, ca) as hs:
                nodes = await hs.list_nodes()
                live_text, _ = await hs.get_policy()
                if tailnet.spec.policy is None:
                    await self._report_missing(obj, live_text, inputs.derived)
                else:
                    applied = await self._render_and_apply(obj, tailnet, inputs.derived, live_text, hs)
                    if applied:
                        nodes = await self._replay_approvals(obj, hs, nodes, inputs)
        except HeadscaleError as exc:
            await self._tailnet_status(obj, {}, Cond("PolicyApplied", "Unknown", "HeadscaleUnavailable",
                                                     f"cannot read or write the policy: {exc}"))
            await self._sites_status(inputs, nodes=None)
            return Result(requeue_after=RESYNC_SECONDS)
        await self._sites_status(inputs, nodes=nodes)
        return Result(requeue_after=RESYNC_SECONDS)

    # -- inputs ---------------------------------------------------------------------------------

    def _mine(self, resource: Any, name: str) -> list[JSON]:
        return [o for o in self.cache.list(resource, index=(TAILNET_INDEX, name))
                if not o["metadata"].get("deletionTimestamp")]

    def _inputs(self, tailnet: Tailnet) -> Inputs:
        name = _name(tailnet)
        sites = _parsed(TailnetSite, self._mine(TAILNET_SITE, name))
        verdicts = judge([SiteRoutes(_name(s), _created(getattr(s.metadata, 'creationTimestamp', '')),
                                     tuple(str(r) for r in s.spec.routes)) for s in sites],
                         [str(r) for r in tailnet.spec.reserved_networks or []])
        egresses = _parsed(TailnetEgress, self._mine(TAILNET_EGRESS, name))
        ingresses = _parsed(TailnetIngress, self._mine(TAILNET_INGRESS, name))
        gateways = _parsed(TailnetGateway, self._mine(TAILNET_GATEWAY, name))
        derived = derive_from_objects(
            egresses=egresses, ingresses=ingresses, gateways=gateways,
            sites=[s for s in sites if not verdicts[_name(s)].blocked])
        return Inputs(derived, sites, verdicts)

    def _access(self, tailnet: Tailnet) -> tuple[str, str, str | None]:
        stored = self._stored_key(tailnet)
        if stored is None:
            raise NoAccess("the Tailnet has no working API key yet; see its Ready condition")
        try:
            ca = self._ca_bundle(tailnet)
        except Problem as problem:
            raise NoAccess(problem.message) from problem
        return self._api_url(tailnet), stored.key, ca

    # -- policy -------------------------------------------------------------------------------

    async def _report_missing(self, obj: JSON, live_text: str, derived: Derived) -> None:
        try:
            live = parse_hujson(live_text, source="the live policy") if live_text.strip() else {}
        except PolicyParseError as exc:
            await self._tailnet_status(obj, {}, Cond("PolicyApplied", "Unknown", "LivePolicyUnreadable", str(exc)))
            return
        gap = missing(live, derived)
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
        await self._tailnet_status(obj, {"policy": policy_status}, cond)

    async def _render_and_apply(self, obj: JSON, tailnet: Tailnet, derived: Derived, live_text: str,
                                hs: Any) -> bool:
        """Render, publish and (in Apply mode) write; True when the live policy equals the render."""
        spec = tailnet.spec.policy
        assert spec is not None
        ref = spec.base_config_map_ref
        base_cm = self.cache.get(CONFIG_MAP, ref.name, ref.namespace)
        if base_cm is None or ref.key not in (base_cm.get("data") or {}):
            what = "does not exist" if base_cm is None else f"has no key {ref.key}"
            await self._tailnet_status(obj, {}, Cond(
                "PolicyApplied", "False", "BasePolicyMissing",
                f"the base policy ConfigMap {ref.namespace}/{ref.name} {what}; nothing was rendered or written"))
            return False
        try:
            base = parse_hujson(base_cm["data"][ref.key], source=f"ConfigMap {ref.namespace}/{ref.name}")
        except PolicyParseError as exc:
            await self._tailnet_status(obj, {}, Cond("PolicyApplied", "False", "BasePolicyInvalid", str(exc)))
            return False
        rendered = render(base, derived)
        await self._publish(obj, tailnet, rendered.text, rendered.hash)
        policy_status: dict[str, Any] = {"renderedHash": rendered.hash,
                                         "renderedConfigMap": rendered_config_map_name(_name(tailnet))}
        if spec.mode != "Apply":
            await self._tailnet_status(obj, {"policy": policy_status}, Cond(
                "PolicyApplied", "False", "RenderOnly",
                f"mode Render: the render is in ConfigMap {self.namespace}/{policy_status['renderedConfigMap']}; "
                "set spec.policy.mode to Apply to write it to Headscale"))
            return False
        if live_text.strip() and not diff_needed(live_text, rendered):
            policy_status["appliedHash"] = rendered.hash
            await self._tailnet_status(obj, {"policy": policy_status}, Cond(
                "PolicyApplied", "True", "Applied", f"the live policy equals the render {rendered.hash[:12]}"))
            return True
        try:
            await hs.check_policy(rendered.text)
            await hs.set_policy(rendered.text)
        except PolicyRejected as exc:
            previous = ((obj.get("status") or {}).get("policy") or {}).get("appliedHash")
            if previous:
                policy_status["appliedHash"] = previous
            await self._tailnet_status(obj, {"policy": policy_status}, Cond(
                "PolicyApplied", "False", "PolicyRejected",
                f"Headscale refused the render {rendered.hash[:12]}; the live policy is unchanged: {exc.message}"))
            await self.events.warning(obj, "PolicyRejected", f"Headscale refused the rendered policy: {exc.message}",
                                      action="ApplyPolicy")
            return False
        policy_status["appliedHash"] = rendered.hash
        await self.events.normal(obj, "PolicyApplied", f"wrote the rendered policy {rendered.hash[:12]} to Headscale",
                                 action="ApplyPolicy")
        await self._tailnet_status(obj, {"policy": policy_status}, Cond(
            "PolicyApplied", "True", "Applied", f"wrote the render {rendered.hash[:12]} to Headscale"))
        return True

    async def _publish(self, obj: JSON, tailnet: Tailnet, text: str, digest: str) -> None:
        name = rendered_config_map_name(_name(tailnet))
        current = self.cache.get(CONFIG_MAP, name, self.namespace)
        if current is not None and (current.get("data") or {}).get(POLICY_KEY) == text:
            return
        await self.client.apply(CONFIG_MAP, {
            "metadata": owned_metadata(obj, name=name, namespace=self.namespace, tailnet=_name(tailnet),
                                       annotations={"tailnet.dev/policy-hash": digest}),
            "data": {POLICY_KEY: text},
        }, field_manager=FIELD_MANAGER)

    # -- approvals and sites ------------------------------------------------------------------

    async def _replay_approvals(self, obj: JSON, hs: Any, nodes: list[Node], inputs: Inputs) -> list[Node]:
        """Approve site routes that tagged routers advertise but Headscale has not approved."""
        updated: list[Node] = []
        for node in nodes:
            wanted: set[str] = set()
            for site in inputs.sites:
                if inputs.verdicts[_name(site)].blocked or str(site.spec.router_tag) not in node.tags:
                    continue
                routes = {str(r) for r in site.spec.routes}
                wanted |= routes & set(node.available_routes) - set(node.approved_routes)
            if wanted:
                node = await hs.add_approved_routes(node, sorted(wanted))
                await self.events.normal(obj, "RoutesApproved",
                                         f"approved {', '.join(sorted(wanted))} on router {node.name}",
                                         action="ApproveRoutes")
            updated.append(node)
        return updated

    async def _sites_status(self, inputs: Inputs, *, nodes: list[Node] | None) -> None:
        for site in inputs.sites:
            verdict = inputs.verdicts[_name(site)]
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
            await self._apply_site_status(site, fields, conds)

    async def _apply_site_status(self, site: TailnetSite, fields: dict[str, Any], conds: list[Cond]) -> None:
        raw = self.cache.get(TAILNET_SITE, _name(site)) or {}
        current = raw.get("status") or {}
        generation = int(raw.get("metadata", {}).get("generation") or 1)
        merged = conditions.merge(current.get("conditions"), conds, generation=generation, now=self._now())
        desired = {**fields, "observedGeneration": generation,
                   "conditions": conditions.only(merged, {c.type for c in conds} | {"Advertised", "Approved"})}
        if all(current.get(k) == v for k, v in desired.items()) and set(current) <= set(desired) | {"conditions"}:
            return
        await self.client.apply_status(TAILNET_SITE, {"metadata": {"name": _name(site)}, "status": desired},
                                       field_manager=FIELD_MANAGER)

    async def _tailnet_status(self, obj: JSON, fields: dict[str, Any], cond: Cond) -> None:
        """Apply ``status.policy`` (kept as it was when ``fields`` has none) and the PolicyApplied condition."""
        current = obj.get("status") or {}
        merged = conditions.merge(current.get("conditions"), [cond], generation=obj["metadata"]["generation"],
                                  now=self._now())
        policy = fields["policy"] if "policy" in fields else current.get("policy")
        desired: dict[str, Any] = {"conditions": conditions.only(merged, {cond.type})}
        if policy:
            desired["policy"] = policy
        if (conditions.get(current.get("conditions"), cond.type) == desired["conditions"][0]
                and (current.get("policy") or None) == (policy or None)):
            return
        await self.client.apply_status(TAILNET, {"metadata": {"name": obj["metadata"]["name"]}, "status": desired},
                                       field_manager=FIELD_MANAGER)


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



def _name(model: Any) -> str:
    """metadata.name of a parsed object (always set on objects read from the API)."""
    return str(model.metadata.name)
