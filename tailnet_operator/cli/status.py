"""``status``: the chain of one object, each link judged from fetched objects (no I/O).

* :func:`egress_status` walks TailnetEgress -> agent pod -> Headscale node -> the policy entries
  that grant its tag -> its targets' routes -> the Tailnet and its key;
* :func:`object_status` does the same for the other kinds (conditions, Events, keys, routers).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.controllers.egress_status import classify
from tailnet_operator.headscale import Node
from tailnet_operator.names import (
    agent_name,
    auth_key_secret_name,
    policy_config_map_name,
    working_key_secret_name,
)
from tailnet_operator.policy import EgressInput, PolicyParseError, derive, missing, parse_hujson
from tailnet_operator.policy import EgressTarget as PolicyTarget
from tailnet_operator.policy.derive import parse_address
from tailnet_operator.types import JSON

from .facts import (
    Facts,
    HeadscaleView,
    by_priority,
    condition_lines,
    conditions,
    event_lines,
    is_true,
    meta,
    parse_time,
    title,
)
from .report import Report, age

__all__ = ["egress_status", "object_status"]


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
    reachable = is_true(tailnet, "Reachable")
    lines = [*condition_lines(tailnet),
             f"Headscale {_api_url(tailnet)} version {status.get('serverVersion', '?')}",
             f"working key {key.get('prefix', '?')} expires {age(expires, facts.now)}" if key else "no working key",
             *event_lines(facts, tailnet)]
    ok = bool(is_true(tailnet, "Ready")) and expires is not None and expires > facts.now
    report.step(f"Tailnet {tailnet_name}", ok, *lines)
    if reachable is False:
        reason = conditions(tailnet)["Reachable"]
        report.find("HeadscaleUnreachable", f"the operator cannot reach Headscale: {reason.get('message', '')}",
                    f"kubectl tailnet status tailnet/{tailnet_name}; check spec.apiURL, the CA and the network "
                    "path from the operator's namespace (docs/runbooks/TailnetUnreachable.md)")
    if not key:
        report.find("NoWorkingKey", f"Tailnet {tailnet_name} has no working API key yet",
                    f"kubectl tailnet status tailnet/{tailnet_name}: see its KeyValid condition and the "
                    "bootstrap key Secret")
    elif expires is not None and expires <= facts.now:
        report.find("KeyExpired", f"the working key of Tailnet {tailnet_name} expired {age(expires, facts.now)}",
                    f"delete the Secret <operator-namespace>/{working_key_secret_name(tailnet_name)} so the operator "
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
    _, namespace, name = meta(obj)
    deploy = agent_name("TailnetEgress", name)
    report = Report(f"TailnetEgress {namespace}/{name}")
    report.step(title(obj), is_true(obj, "Ready"), *condition_lines(obj), *event_lines(facts, obj))
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
                    f"kubectl -n {namespace} describe deployment {deploy} (its ReplicaSet's events "
                    "say why no pod was created: Pod Security, quota, image)")
    for pod in facts.pods:
        pod_name = pod["metadata"]["name"]
        ready = _pod_ready(pod)
        report.step(f"agent pod {pod_name}", ready, *_pod_lines(pod), *event_lines(facts, pod))
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
                            f"kubectl -n {namespace} logs deploy/{deploy}: look for control errors")
            else:
                report.find("AgentDown", f"no node in Headscale carries {tag}: the agent has not joined",
                            f"kubectl -n {namespace} logs deploy/{deploy}")
        else:
            report.step(f"Headscale node {node.given_name or node.name} (id {node.id})", node.online,
                        f"online {node.online}, last seen {age(node.last_seen, facts.now)}",
                        f"tags {', '.join(node.tags) or '-'}; addresses {', '.join(node.ip_addresses)}")
            if not node.online:
                report.find("AgentDown", f"the agent's node {node.given_name or node.name} is offline "
                            f"(last seen {age(node.last_seen, facts.now)})",
                            f"kubectl -n {namespace} logs deploy/{deploy}: look for control errors "
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
    return by_priority(report)


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
    kind, _, name = meta(obj)
    if kind == "TailnetEgress":
        return egress_status(facts)
    report = Report(title(obj))
    if kind == "Tailnet":
        _tailnet_step(report, Facts(facts.now, obj, obj, events=facts.events), name)
        policy, rendered = conditions(obj).get("PolicyApplied"), policy_config_map_name(name)
        if policy is not None and policy.get("status") != "True":
            report.find(str(policy.get("reason") or "PolicyNotApplied"), str(policy.get("message", "")),
                        f"kubectl -n <operator-namespace> get configmap {rendered} -o yaml; fix the base "
                        "policy (docs/runbooks/TailnetPolicyRejected.md)")
        report.healthy_hint = f"kubectl tailnet status tailnetegress/NAME for each egress of Tailnet {name}"
        return by_priority(report)
    report.step(title(obj), is_true(obj, "Ready"), *condition_lines(obj), *event_lines(facts, obj))
    status = obj.get("status") or {}
    for router in status.get("routers") or []:
        report.step(f"router {router.get('node', '?')}", None,
                    f"advertised {', '.join(router.get('advertised') or []) or '-'}; "
                    f"approved {', '.join(router.get('approved') or []) or '-'}")
    ready = conditions(obj).get("Ready")
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
    return by_priority(report)
