"""``diagnose``: why can't a pod reach a target: the target's egress, the consumer namespace rule,
then the egress chain for that target alone (from fetched objects, no I/O)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tailnet_operator.types import JSON

from .facts import Facts, by_priority, meta
from .report import Report
from .status import egress_status

__all__ = ["diagnose", "find_target"]

_SVC = re.compile(r"^(?P<name>[a-z0-9-]+)(\.(?P<ns>[a-z0-9-]+)(\.svc(\.cluster\.local)?)?)?(:(?P<port>\d+))?$")


def find_target(target: str, egresses: Sequence[JSON]) -> list[tuple[JSON, str]]:
    """The (egress, target name) pairs ``target`` may mean: ``NAME[.NS[.svc]][:PORT]``, ``EGRESS/NAME``
    or the target's address."""
    matches: list[tuple[JSON, str]] = []
    egress_name, _, short = target.partition("/")
    parsed = _SVC.match(target) if not short else None
    for egress in egresses:
        _, namespace, name = meta(egress)
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
    _, pod_ns, pod_name = meta(pod)
    phase = (pod.get("status") or {}).get("phase")
    report.step(f"pod {pod_ns}/{pod_name}", phase == "Running", f"phase {phase}")
    if phase != "Running":
        report.find("PodNotRunning", f"pod {pod_ns}/{pod_name} is {phase}",
                    f"kubectl -n {pod_ns} describe pod {pod_name}")
    matches = find_target(target, egresses)
    if not matches:
        known = sorted(f"{t.get('name')}.{meta(e)[1]}.svc" for e in egresses
                       for t in (e.get("spec") or {}).get("targets") or [])
        report.step(f"target {target}", False, "no TailnetEgress has such a target")
        report.find("NoSuchTarget", f"no TailnetEgress target matches {target!r}",
                    f"use one of: {', '.join(known) or 'none defined (kubectl get tailnetegresses -A)'}")
        return by_priority(report)
    egress, tname = matches[0]
    _, egress_ns, egress_name = meta(egress)
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
    return by_priority(report)
