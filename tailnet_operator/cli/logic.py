"""The CLI's answers as pure functions of fetched objects: no I/O, so every broken case is a unit test.

* :func:`egress_status` walks TailnetEgress -> agent pod -> Headscale node -> the policy entries
  that grant its tag -> its targets' routes -> the Tailnet and its key;
* :func:`object_status` does the same for the other kinds (conditions, Events, keys, routers);
* :func:`diagnose` answers "why can't pod X reach target Y": the target's egress, the consumer
  namespace rule, then the egress chain for that target alone;
* :func:`check` verifies an installation: CRDs, the operator's readiness and leader, versions,
  and each Tailnet's Headscale and key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import ValidationError

from tailnet_operator.api import BY_KIND
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers.egress_status import classify
from tailnet_operator.headscale import Node
from tailnet_operator.names import auth_key_secret_name
from tailnet_operator.policy import EgressInput, PolicyParseError, derive, missing, parse_hujson
from tailnet_operator.policy import EgressTarget as PolicyTarget
from tailnet_operator.policy.derive import parse_address
from tailnet_operator.types import JSON

from .report import Report, age

__all__ = [
    "MIN_KUBERNETES",
    "SUPPORTED_HEADSCALE",
    "CheckFacts",
    "Facts",
    "HeadscaleView",
    "check",
    "diagnose",
    "egress_status",
    "object_status",
    "parse_time",
]

MIN_KUBERNETES = (1, 30)
"""The chart's kubeVersion floor."""
SUPPORTED_HEADSCALE = ((0, 29), (0, 30))
"""Headscale minors the client is written for (inclusive)."""

_PRIORITY = {"TailnetNotFound": 0, "HeadscaleUnreachable": 0, "NoWorkingKey": 0, "KeyExpired": 0,
             "NoSuchTarget": 0, "PodNotRunning": 1, "NamespaceNotAllowed": 1, "TagNotOwned": 2,
             "AgentDown": 3, "AgentNotJoined": 3, "NotAdvertised": 4, "NotApproved": 4, "NoGrant": 4}
"""Which cause comes first when several are found: the one the others follow from (an agent
cannot join with a tag nobody owns; nothing is routed through an agent that is down)."""


@dataclass(frozen=True)
class HeadscaleView:
    """What the CLI read from a Tailnet's Headscale with the operator's working key.

    ``nodes``/``policy`` are None when they could not be read; ``error`` then says why.
    """

    nodes: tuple[Node, ...] | None = None
    policy: str | None = None
    version: str = ""
    error: str = ""
    no_key: bool = False
    """Not contacted because the operator's namespace holds no working key for the Tailnet."""


@dataclass(frozen=True)
class Facts:
    """Everything one status question needs, fetched beforehand."""

    now: datetime
    obj: JSON
    tailnet: JSON | None = None
    pods: tuple[JSON, ...] = ()
    headscale: HeadscaleView | None = None
    events: Mapping[str, Sequence[JSON]] = field(default_factory=dict)
    """Events by ``event_key(kind, namespace, name)``."""


def event_key(kind: str, namespace: str, name: str) -> str:
    return f"{kind}/{namespace}/{name}"


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _meta(obj: JSON) -> tuple[str, str, str]:
    meta = obj.get("metadata") or {}
    return str(obj.get("kind", "")), str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _title(obj: JSON) -> str:
    kind, namespace, name = _meta(obj)
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def _conditions(obj: JSON) -> dict[str, JSON]:
    return {str(c.get("type")): c for c in (obj.get("status") or {}).get("conditions") or [] if isinstance(c, dict)}


def _condition_lines(obj: JSON) -> list[str]:
    return [f"{t}={c.get('status')} ({c.get('reason', '')}): {c.get('message', '')}".rstrip(": ")
            for t, c in _conditions(obj).items()]


def _is_true(obj: JSON | None, condition: str) -> bool | None:
    if obj is None:
        return None
    cond = _conditions(obj).get(condition)
    if cond is None or cond.get("status") not in ("True", "False"):
        return None
    return cond.get("status") == "True"


def _event_lines(facts: Facts, obj: JSON) -> list[str]:
    kind, namespace, name = _meta(obj)
    events = sorted(facts.events.get(event_key(kind, namespace, name), ()),
                    key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    lines = []
    for event in events[-5:]:
        when = parse_time(event.get("lastTimestamp") or event.get("eventTime"))
        count = event.get("count") or (event.get("series") or {}).get("count") or 1
        times = f" x{count}" if count and int(count) > 1 else ""
        lines.append(f"event {event.get('type', 'Normal')} {event.get('reason', '')}{times} "
                     f"({age(when, facts.now)}): {event.get('message', '')}")
    return lines


def _sorted(report: Report) -> Report:
    report.findings.sort(key=lambda f: _PRIORITY.get(f.cause, 5))
    return report


# -- the Tailnet link, shared by every kind ---------------------------------------------------------

def _tailnet_step(report: Report, facts: Facts, tailnet_name: str) -> None:
    tailnet = facts.tailnet
    if tailnet is None:
        report.step(f"Tailnet {tailnet_name}", False, "not found")
        report.find("TailnetNotFound", f"the Tailnet {tailnet_name!r} does not exist",
                    "kubectl get tailnets; fix spec.tailnetRef.name or create the Tailnet")
        return
    status = tailnet.get("status") or {}
    key = status.get("apiKey") or {}
    expires = parse_time(key.get("expiresAt"))
    reachable = _is_true(tailnet, "Reachable")
    lines = [*_condition_lines(tailnet),
             f"Headscale {_api_url(tailnet)} version {status.get('serverVersion', '?')}",
             f"working key {key.get('prefix', '?')} expires {age(expires, facts.now)}" if key else "no working key",
             *_event_lines(facts, tailnet)]
    ok = bool(_is_true(tailnet, "Ready")) and expires is not None and expires > facts.now
    report.step(f"Tailnet {tailnet_name}", ok, *lines)
    if reachable is False:
        reason = _conditions(tailnet)["Reachable"]
        report.find("HeadscaleUnreachable", f"the operator cannot reach Headscale: {reason.get('message', '')}",
                    f"kubectl tailnet status tailnet/{tailnet_name}; check spec.apiURL, the CA and the network "
                    "path from the operator's namespace (docs/runbooks/TailnetUnreachable.md)")
    if not key:
        report.find("NoWorkingKey", f"Tailnet {tailnet_name} has no working API key yet",
                    f"kubectl tailnet status tailnet/{tailnet_name}: see its KeyValid condition and the "
                    "bootstrap key Secret")
    elif expires is not None and expires <= facts.now:
        report.find("KeyExpired", f"the working key of Tailnet {tailnet_name} expired {age(expires, facts.now)}",
                    f"delete the Secret <operator-namespace>/{tailnet_name}-headscale-api-key so the operator "
                    "mints a new one from the bootstrap key (docs/runbooks/TailnetKeyExpiringSoon.md)")


def _api_url(tailnet: JSON) -> str:
    spec = tailnet.get("spec") or {}
    return str(spec.get("apiURL") or spec.get("loginURL") or "?")


def _headscale_step(report: Report, view: HeadscaleView | None, tailnet_name: str) -> bool:
    """Record whether Headscale could be read; True when nodes and policy are there."""
    if view is None or view.error or view.nodes is None:
        why = view.error if view is not None and view.error else "not contacted"
        report.step("Headscale", False, why)
        report.find("HeadscaleUnreachable", f"Headscale of Tailnet {tailnet_name} could not be read: {why}",
                    "kubectl tailnet check: it tries Headscale with the operator's key; then the Tailnet's "
                    "Reachable condition (docs/runbooks/TailnetUnreachable.md)")
        return False
    report.step("Headscale", True, f"version {view.version or '?'}, {len(view.nodes)} nodes")
    return True


# -- TailnetEgress ------------------------------------------------------------------------------------

def _pod_ready(pod: JSON) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _pod_lines(pod: JSON) -> list[str]:
    status = pod.get("status") or {}
    lines = [f"phase {status.get('phase', '?')}, ready {_pod_ready(pod)}, IP {status.get('podIP', '-')}"]
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        detail = next(iter(state), "?")
        why = (state.get(detail) or {}).get("reason", "")
        lines.append(f"container {cs.get('name')}: {detail}{' ' + why if why else ''}, "
                     f"restarts {cs.get('restartCount', 0)}")
    return lines


def _agent_node(egress: JSON, nodes: Sequence[Node], tag: str) -> Node | None:
    wanted = str(((egress.get("status") or {}).get("node") or {}).get("id") or "")
    if wanted:
        for node in nodes:
            if node.id == wanted:
                return node
    tagged = [n for n in nodes if tag in n.tags]
    return next((n for n in tagged if n.online), tagged[0] if tagged else None)


def _granting_entries(policy: JSON, tag: str) -> list[str]:
    lines = []
    for i, acl in enumerate(policy.get("acls") or []):
        if isinstance(acl, dict) and tag in (acl.get("src") or []):
            dst = ", ".join(map(str, acl.get("dst") or []))
            lines.append(f"acls[{i}]: {acl.get('action', 'accept')} {tag} -> {dst}")
    for i, grant in enumerate(policy.get("grants") or []):
        if isinstance(grant, dict) and tag in (grant.get("src") or []):
            lines.append(f"grants[{i}]: {tag} -> {', '.join(map(str, grant.get('dst') or []))} "
                         f"ip {', '.join(map(str, grant.get('ip') or ['*']))}")
    return lines


def egress_status(facts: Facts, *, only_target: str | None = None) -> Report:
    """The chain of one TailnetEgress (``only_target``: judge only that target's route)."""
    obj = facts.obj
    _, namespace, name = _meta(obj)
    report = Report(f"TailnetEgress {namespace}/{name}")
    report.step(_title(obj), _is_true(obj, "Ready"), *_condition_lines(obj), *_event_lines(facts, obj))
    try:
        # the spec is what the chain needs; status is judged field by field below
        egress = TailnetEgress.model_validate({k: v for k, v in obj.items() if k != "status"})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        report.find("InvalidSpec", f"the object does not parse: {where}: {error.get('msg', '')}",
                    f"kubectl -n {namespace} edit tailnetegress {name}")
        return report
    tag, tailnet_name = egress.spec.tag, egress.spec.tailnet_ref.name

    # agent pod
    if not facts.pods:
        report.step("agent pod", False, "no pod")
        report.find("AgentDown", "no agent pod exists",
                    f"kubectl -n {namespace} describe deployment {name}-egress-agent (its ReplicaSet's events "
                    "say why no pod was created: Pod Security, quota, image)")
    for pod in facts.pods:
        pod_name = pod["metadata"]["name"]
        ready = _pod_ready(pod)
        report.step(f"agent pod {pod_name}", ready, *_pod_lines(pod), *_event_lines(facts, pod))
        if not ready:
            report.find("AgentDown", f"agent pod {pod_name} is not Ready",
                        f"kubectl -n {namespace} logs {pod_name} (and describe it for probe failures)")

    # Headscale node and policy
    view = facts.headscale
    readable = _headscale_step(report, view, tailnet_name)
    live_policy = view.policy if view is not None else None
    nodes: Sequence[Node] = view.nodes if view is not None and view.nodes is not None else ()
    if readable:
        node = _agent_node(obj, nodes, tag)
        if node is None:
            report.step(f"Headscale node with {tag}", False, "none")
            if facts.pods and all(_pod_ready(p) for p in facts.pods):
                report.find("AgentNotJoined", f"no node in Headscale carries {tag}",
                            f"kubectl -n {namespace} logs deploy/{name}-egress-agent: look for control errors")
            else:
                report.find("AgentDown", f"no node in Headscale carries {tag}: the agent has not joined",
                            f"kubectl -n {namespace} logs deploy/{name}-egress-agent")
        else:
            report.step(f"Headscale node {node.given_name or node.name} (id {node.id})", node.online,
                        f"online {node.online}, last seen {age(node.last_seen, facts.now)}",
                        f"tags {', '.join(node.tags) or '-'}; addresses {', '.join(node.ip_addresses)}")
            if not node.online:
                report.find("AgentDown", f"the agent's node {node.given_name or node.name} is offline "
                            f"(last seen {age(node.last_seen, facts.now)})",
                            f"kubectl -n {namespace} logs deploy/{name}-egress-agent: look for control errors "
                            "(docs/runbooks/TailnetAgentDisconnected.md)")
        routers = [n for n in nodes if n.available_routes]
        all_approved = all(set(n.available_routes) <= set(n.approved_routes) for n in routers)
        report.step("subnet routers", True if routers and all_approved else None,
                    *[f"{n.given_name or n.name}: advertises {', '.join(n.available_routes)}; approved "
                      f"{', '.join(n.approved_routes) or 'none'}; online {n.online}" for n in routers])
    if readable and live_policy is not None:
        _policy_step(report, egress, live_policy, tailnet_name)
        for target in egress.spec.targets:
            if only_target is not None and target.name != only_target:
                continue
            state = classify(egress, target, agent=None, nodes=nodes, live_policy=live_policy)
            fallback = next((t for t in (obj.get("status") or {}).get("targets") or []
                             if t.get("name") == target.name), None)
            route, message = state.route, state.message
            if route == "Unknown" and fallback and fallback.get("route") not in (None, "Unknown"):
                route, message = str(fallback["route"]), str(fallback.get("message", ""))
            elif route == "Unknown" and parse_address(target.address) is not None:
                route, message = "Routed", "Headscale has a route to it approved and the policy grants the tag"
            ports = ", ".join(str(p.port) for p in target.ports)
            report.step(f"target {target.name} ({target.address}:{ports})",
                        None if route == "Unknown" else route in ("Ready", "Routed"), f"route {route}: {message}")
            _route_finding(report, route, message, tag, target.address, ports, state.router, tailnet_name)

    # Tailnet and keys
    _tailnet_step(report, facts, tailnet_name)
    key = (obj.get("status") or {}).get("preAuthKey") or {}
    expires = parse_time(key.get("expiresAt"))
    if expires is not None:
        report.step("pre-auth key", expires > facts.now,
                    f"{key.get('prefix', '?')} expires {age(expires, facts.now)}, "
                    f"next rotation {age(parse_time(key.get('nextRotationAt')), facts.now)}")
        if expires <= facts.now:
            report.find("PreAuthKeyExpired", f"the agent's pre-auth key expired {age(expires, facts.now)}",
                        f"kubectl -n {namespace} delete secret {auth_key_secret_name('TailnetEgress', name)} "
                        "(the operator makes a new key); "
                        "see docs/runbooks/TailnetPreAuthKeyExpiringSoon.md")
    first = egress.spec.targets[0] if egress.spec.targets else None
    target_name = only_target or (first.name if first else "TARGET")
    port = first.ports[0].port if first and first.ports else 80
    report.healthy_hint = (f"from a consumer pod: kubectl exec POD -- nc -vz {target_name}.{namespace}.svc {port}; "
                           f"if that fails: kubectl tailnet diagnose POD {target_name}.{namespace}.svc")
    return _sorted(report)


def _policy_step(report: Report, egress: TailnetEgress, live_policy: str, tailnet_name: str) -> None:
    tag = egress.spec.tag
    try:
        doc = parse_hujson(live_policy) if live_policy.strip() else {}
    except PolicyParseError as exc:
        report.step("policy", False, f"the live policy does not parse: {exc}")
        return
    targets = tuple(PolicyTarget(address=t.address, ports=tuple(p.port for p in t.ports))
                    for t in egress.spec.targets)
    try:
        lacks = missing(live_policy or None, derive(egresses=[EgressInput(tag=tag, targets=targets)]))
    except (PolicyParseError, ValueError) as exc:
        report.step("policy", False, f"cannot compare with the live policy: {exc}")
        return
    owned = not any(o.tag == tag for o in lacks.tag_owners)
    entries = _granting_entries(doc, tag) if isinstance(doc, dict) else []
    report.step(f"policy entries for {tag}", owned,
                f"tagOwners has {tag}: {owned}" if live_policy.strip() else "no policy stored: everything is allowed",
                *(entries or ["no acls or grants entry names the tag as a source"]))
    if not owned:
        report.find("TagNotOwned", f"the live policy has no tagOwners entry for {tag}: the agent cannot use the tag",
                    f'add "{tag}": [] to tagOwners of the base policy, or set spec.policy on Tailnet '
                    f"{tailnet_name} so the operator renders it (kubectl tailnet status tailnet/{tailnet_name})")


def _route_finding(report: Report, route: str, message: str, tag: str, address: str, ports: str,
                   router: str | None, tailnet_name: str) -> None:
    if route == "NotApproved":
        report.find("NotApproved", message,
                    f"approve the route on {router or 'the router'} (headscale nodes approve-routes), or check the "
                    "TailnetSite that covers it: kubectl tailnet status tailnetsite/NAME "
                    "(docs/runbooks/TailnetRoutesNotApproved.md)")
    elif route == "NotAdvertised":
        report.find("NotAdvertised", message,
                    f"advertise a route covering {address} on a subnet router (a TailnetSite with its routerTag)")
    elif route == "NoGrant":
        report.find("NoGrant", message,
                    f"add a grant from {tag} to {address} ports {ports} in the base policy, or set spec.policy on "
                    f"Tailnet {tailnet_name} so the operator renders it")


# -- other kinds ------------------------------------------------------------------------------------

def object_status(facts: Facts) -> Report:
    """Status of a Tailnet, TailnetSite, TailnetIngress or TailnetGateway; a TailnetEgress goes to
    :func:`egress_status`."""
    obj = facts.obj
    kind, _, name = _meta(obj)
    if kind == "TailnetEgress":
        return egress_status(facts)
    report = Report(_title(obj))
    if kind == "Tailnet":
        _tailnet_step(report, Facts(facts.now, obj, obj, events=facts.events), name)
        policy = _conditions(obj).get("PolicyApplied")
        if policy is not None and policy.get("status") != "True":
            report.find(str(policy.get("reason") or "PolicyNotApplied"), str(policy.get("message", "")),
                        f"kubectl -n <operator-namespace> get configmap {name}-policy -o yaml; fix the base "
                        "policy (docs/runbooks/TailnetPolicyRejected.md)")
        report.healthy_hint = f"kubectl tailnet status tailnetegress/NAME for each egress of Tailnet {name}"
        return _sorted(report)
    report.step(_title(obj), _is_true(obj, "Ready"), *_condition_lines(obj), *_event_lines(facts, obj))
    status = obj.get("status") or {}
    for router in status.get("routers") or []:
        report.step(f"router {router.get('node', '?')}", None,
                    f"advertised {', '.join(router.get('advertised') or []) or '-'}; "
                    f"approved {', '.join(router.get('approved') or []) or '-'}")
    ready = _conditions(obj).get("Ready")
    if ready is not None and ready.get("status") != "True":
        reason = str(ready.get("reason") or "NotReady")
        hint = {"NotApproved": "approve the routes (headscale nodes approve-routes) or let the operator own the "
                               "policy; docs/runbooks/TailnetRoutesNotApproved.md",
                "NoRouter": "start a subnet router that carries spec.routerTag",
                "NotAdvertised": "advertise the listed routes on the router (tailscale set --advertise-routes)",
                "Blocked": "kubectl get tailnetsites: resolve the overlap named in status.blockedBy",
                "NamespaceNotGranted": f"bind the tenant ClusterRole in namespace {obj['metadata'].get('namespace')}: "
                                       "the message holds the kubectl create rolebinding command "
                                       "(docs/reference/rbac.md)",
                "HostNameClash": "give one of the hosts another alias, or move its expose to another port"}
        report.find(reason, str(ready.get("message", "")),
                    hint.get(reason, f"kubectl describe {kind.lower()} {name}; see docs/troubleshooting"))
    ref = ((obj.get("spec") or {}).get("tailnetRef") or {}).get("name")
    if ref:
        _tailnet_step(report, facts, str(ref))
    report.healthy_hint = f"kubectl get {kind.lower()} -A -o wide"
    return _sorted(report)


# -- diagnose ---------------------------------------------------------------------------------------

_SVC = re.compile(r"^(?P<name>[a-z0-9-]+)(\.(?P<ns>[a-z0-9-]+)(\.svc(\.cluster\.local)?)?)?(:(?P<port>\d+))?$")


def find_target(target: str, egresses: Sequence[JSON]) -> list[tuple[JSON, str]]:
    """The (egress, target name) pairs ``target`` may mean: ``NAME[.NS[.svc]][:PORT]``, ``EGRESS/NAME``
    or the target's address."""
    matches: list[tuple[JSON, str]] = []
    egress_name, _, short = target.partition("/")
    parsed = _SVC.match(target) if not short else None
    for egress in egresses:
        _, namespace, name = _meta(egress)
        for t in (egress.get("spec") or {}).get("targets") or []:
            tname = str(t.get("name"))
            if short:
                hit = egress_name == name and short == tname
            elif parsed is not None and parsed["name"] == tname:
                hit = parsed["ns"] in (None, namespace)
            else:
                hit = str(t.get("address")) == target.rsplit(":", 1)[0] if target.count(":") == 1 \
                    else str(t.get("address")) == target
            if hit:
                matches.append((egress, tname))
    return matches


def diagnose(pod: JSON | None, pod_ref: str, target: str, egresses: Sequence[JSON],
             facts_of: Mapping[str, Facts]) -> Report:
    """Why can't ``pod`` reach ``target``. ``facts_of`` maps an egress name to its status facts."""
    report = Report(f"{pod_ref} -> {target}")
    if pod is None:
        report.step(f"pod {pod_ref}", False, "not found")
        report.find("PodNotFound", f"pod {pod_ref} does not exist", "kubectl get pods -A | grep NAME")
        return report
    _, pod_ns, pod_name = _meta(pod)
    phase = (pod.get("status") or {}).get("phase")
    report.step(f"pod {pod_ns}/{pod_name}", phase == "Running", f"phase {phase}")
    if phase != "Running":
        report.find("PodNotRunning", f"pod {pod_ns}/{pod_name} is {phase}",
                    f"kubectl -n {pod_ns} describe pod {pod_name}")
    matches = find_target(target, egresses)
    if not matches:
        known = sorted(f"{t.get('name')}.{_meta(e)[1]}.svc" for e in egresses
                       for t in (e.get("spec") or {}).get("targets") or [])
        report.step(f"target {target}", False, "no TailnetEgress has such a target")
        report.find("NoSuchTarget", f"no TailnetEgress target matches {target!r}",
                    f"use one of: {', '.join(known) or 'none defined (kubectl get tailnetegresses -A)'}")
        return _sorted(report)
    egress, tname = matches[0]
    _, egress_ns, egress_name = _meta(egress)
    consumers = [str(n) for n in (egress.get("spec") or {}).get("consumerNamespaces") or []]
    allowed = pod_ns in consumers
    report.step(f"TailnetEgress {egress_ns}/{egress_name} target {tname}", allowed,
                f"service {tname}.{egress_ns}.svc; consumer namespaces {', '.join(consumers)}")
    if not allowed:
        report.find("NamespaceNotAllowed",
                    f"namespace {pod_ns} is not in spec.consumerNamespaces of {egress_name}: its NetworkPolicy "
                    "drops the connection",
                    f"kubectl -n {egress_ns} edit tailnetegress {egress_name}: add {pod_ns} to consumerNamespaces")
    facts = facts_of.get(egress_name)
    if facts is not None:
        chain = egress_status(facts, only_target=tname)
        report.steps.extend(chain.steps)
        for finding in chain.findings:
            report.find(finding.cause, finding.message, finding.next_step)
        report.healthy_hint = chain.healthy_hint.replace("POD", f"-n {pod_ns} {pod_name}", 1)
    return _sorted(report)


# -- check ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckFacts:
    """An installation as fetched: the project's CRDs, the operator's Deployment, Lease and pods,
    the versions, each Tailnet and what its Headscale answered."""

    now: datetime
    cli_version: str
    kubernetes_version: str
    crds: tuple[JSON, ...] = ()
    deployment: JSON | None = None
    lease: JSON | None = None
    tailnets: tuple[JSON, ...] = ()
    headscale: Mapping[str, HeadscaleView] = field(default_factory=dict)
    namespace: str = "tailnet-system"


def _version(text: str) -> tuple[int, int] | None:
    match = re.search(r"v?(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def check(facts: CheckFacts) -> Report:
    """Is this installation able to work: every finding is a reason it is not."""
    report = Report(f"tailnet-operator installation in {facts.namespace}")
    kube = _version(facts.kubernetes_version)
    kube_ok = kube is not None and kube >= MIN_KUBERNETES
    report.step(f"Kubernetes {facts.kubernetes_version}", kube_ok)
    if not kube_ok:
        report.find("KubernetesTooOld", f"Kubernetes {facts.kubernetes_version} is older than "
                    f"{MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]}", "upgrade the cluster")

    by_kind = {str(((c.get("spec") or {}).get("names") or {}).get("kind")): c for c in facts.crds}
    for kind, info in sorted(BY_KIND.items()):
        crd = by_kind.get(kind)
        if crd is None:
            report.step(f"CRD {info.plural}.{info.group}", False, "missing")
            report.find("CRDMissing", f"the CRD {info.plural}.{info.group} is not installed",
                        "install the CRDs: helm upgrade --install with crds.enabled=true, "
                        "or kubectl apply -k manifests/")
            continue
        established = any(c.get("type") == "Established" and c.get("status") == "True"
                          for c in (crd.get("status") or {}).get("conditions") or [])
        served = [v.get("name") for v in (crd.get("spec") or {}).get("versions") or [] if v.get("served")]
        ok = established and info.version in served
        report.step(f"CRD {info.plural}.{info.group}", ok,
                    f"established {established}, served {', '.join(map(str, served))}")
        if not ok:
            report.find("CRDNotServed", f"the CRD {info.plural}.{info.group} is not established or does not serve "
                        f"{info.version}",
                        "kubectl get crd -o yaml: see its conditions; upgrade the CRDs with the chart")

    dep = facts.deployment
    if dep is None:
        report.step("operator Deployment", False, "not found")
        report.find("OperatorMissing", f"no tailnet-operator Deployment in {facts.namespace}",
                    "helm install tailnet-operator manifests/chart/tailnet-operator, or pass --namespace")
    else:
        status = dep.get("status") or {}
        available, wanted = int(status.get("availableReplicas") or 0), int((dep.get("spec") or {}).get("replicas") or 0)
        images = [str(c.get("image")) for c in ((dep.get("spec") or {}).get("template") or {}).get("spec", {}).get(
            "containers", [])]
        labels = (dep.get("metadata") or {}).get("labels") or {}
        report.step(f"operator Deployment {dep['metadata']['name']}", available >= 1,
                    f"available {available}/{wanted}; image {', '.join(images)}")
        if available < 1:
            report.find("OperatorNotReady", "no operator replica is Ready",
                        f"kubectl -n {facts.namespace} describe deployment {dep['metadata']['name']}; "
                        f"kubectl -n {facts.namespace} logs deploy/{dep['metadata']['name']}")
        running = str(labels.get("app.kubernetes.io/version") or "")
        if running and _version(running) != _version(facts.cli_version):
            report.find("VersionSkew", f"the operator runs {running}, this CLI is {facts.cli_version}",
                        "use the CLI of the installed version (it is in the operator image: kubectl exec deploy/... "
                        "-- /tailnet-operator status ...)")
    lease = facts.lease
    holder = str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")
    renewed = parse_time(((lease or {}).get("spec") or {}).get("renewTime"))
    duration = int(((lease or {}).get("spec") or {}).get("leaseDurationSeconds") or 15)
    leading = bool(holder) and renewed is not None and (facts.now - renewed).total_seconds() <= duration
    if dep is not None:
        report.step("leader", leading, f"holder {holder or '-'}, renewed {age(renewed, facts.now)}")
        if not leading and int(((dep.get("status") or {}).get("availableReplicas")) or 0) >= 1:
            report.find("NoLeader", "no replica holds the Lease tailnet-operator: nothing reconciles",
                        f"kubectl -n {facts.namespace} logs deploy/{dep['metadata']['name']} | grep -i lease")

    if not facts.tailnets:
        report.step("Tailnets", None, "none yet")
    for tailnet in facts.tailnets:
        name = _meta(tailnet)[2]
        view = facts.headscale.get(name)
        reachable = _conditions(tailnet).get("Reachable") or {}
        if view is not None and view.no_key and reachable.get("status") != "False":
            # reconciled by no operator yet (then the key check below finds it), or by one in
            # another namespace: nothing this installation can vouch for
            report.step(f"Tailnet {name}: Headscale", None,
                        f"no working key in {facts.namespace}; the operator's view: "
                        f"Reachable={reachable.get('status', 'Unknown')}")
        elif view is not None and view.no_key:
            report.step(f"Tailnet {name}: Headscale", False, str(reachable.get("message", "")))
            report.find("HeadscaleUnreachable", f"Headscale of Tailnet {name}: {reachable.get('message', '')}",
                        f"kubectl tailnet status tailnet/{name} (docs/runbooks/TailnetUnreachable.md)")
        elif view is None or view.error:
            why = view.error if view is not None else "not contacted"
            report.step(f"Tailnet {name}: Headscale", False, why)
            report.find("HeadscaleUnreachable", f"Headscale of Tailnet {name}: {why}",
                        f"kubectl tailnet status tailnet/{name} (docs/runbooks/TailnetUnreachable.md)")
        else:
            hs = _version(view.version)
            supported = hs is not None and SUPPORTED_HEADSCALE[0] <= hs <= SUPPORTED_HEADSCALE[1]
            report.step(f"Tailnet {name}: Headscale {view.version}", supported,
                        f"{len(view.nodes or ())} nodes")
            if not supported:
                lo, hi = SUPPORTED_HEADSCALE
                report.find("HeadscaleVersionUnsupported", f"Headscale {view.version} is outside "
                            f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}", "upgrade Headscale or the operator")
        key = (tailnet.get("status") or {}).get("apiKey") or {}
        expires = parse_time(key.get("expiresAt"))
        key_ok = expires is not None and expires > facts.now
        report.step(f"Tailnet {name}: working key", key_ok,
                    f"{key.get('prefix', '-')} expires {age(expires, facts.now)}" if key else "none")
        if not key_ok:
            cause = "KeyExpired" if expires is not None else "NoWorkingKey"
            report.find(cause, f"Tailnet {name} has {'an expired' if expires else 'no'} working key",
                        f"kubectl tailnet status tailnet/{name}: its KeyValid condition names the cause")
    report.healthy_hint = "kubectl tailnet status tailnet/NAME, then tailnetegress/NAME for each egress"
    return _sorted(report)
