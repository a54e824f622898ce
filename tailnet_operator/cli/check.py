"""``check``: is this installation able to work: CRDs, the operator's readiness and leader,
versions, and each Tailnet's Headscale and key (from fetched objects, no I/O)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from tailnet_operator.api import BY_KIND
from tailnet_operator.types import JSON

from .facts import HeadscaleView, by_priority, conditions, meta, parse_time
from .report import Report, age

__all__ = ["MIN_KUBERNETES", "SUPPORTED_HEADSCALE", "CheckFacts", "check"]

MIN_KUBERNETES = (1, 30)
"""The chart's kubeVersion floor."""
SUPPORTED_HEADSCALE = ((0, 29), (0, 30))
"""Headscale minors the client is written for (inclusive)."""


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
        name = meta(tailnet)[2]
        view = facts.headscale.get(name)
        reachable = conditions(tailnet).get("Reachable") or {}
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
    return by_priority(report)
