"""``check`` from fetched objects: a working installation passes, and each broken part is a cause."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tailnet_operator.cli.check import CheckFacts, check
from tailnet_operator.cli.facts import HeadscaleView

from .builders import NOW, iso, tailnet, view


def crd(kind: str, plural: str, established: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": f"{plural}.tailnet.dev"},
            "spec": {"group": "tailnet.dev", "names": {"kind": kind, "plural": plural},
                     "versions": [{"name": "v1alpha1", "served": True}]},
            "status": {"conditions": [{"type": "Established", "status": "True" if established else "False"}]}}


CRDS = (crd("Tailnet", "tailnets"), crd("TailnetEgress", "tailnetegresses"),
        crd("TailnetIngress", "tailnetingresses"), crd("TailnetSite", "tailnetsites"),
        crd("TailnetGateway", "tailnetgateways"))
DEPLOYMENT = {"metadata": {"name": "tailnet-operator", "labels": {"app.kubernetes.io/version": "0.1.0"}},
              "spec": {"replicas": 2,
                       "template": {"spec": {"containers": [{"image": "localhost/tailnet-operator:x"}]}}},
              "status": {"availableReplicas": 2}}
LEASE = {"spec": {"holderIdentity": "tailnet-operator-abc_1", "renewTime": iso(NOW - timedelta(seconds=2)),
                  "leaseDurationSeconds": 15}}


def check_facts(**changes: Any) -> CheckFacts:
    base: dict[str, Any] = {"now": NOW, "cli_version": "0.1.0", "kubernetes_version": "v1.36.3", "crds": CRDS,
                            "deployment": DEPLOYMENT, "lease": LEASE, "tailnets": (tailnet(),),
                            "headscale": {"home": view()}}
    base.update(changes)
    return CheckFacts(**base)


def test_check_passes_on_a_working_installation() -> None:
    report = check(check_facts())
    assert report.ok, report.render()


@pytest.mark.parametrize(("changes", "cause"), [
    ({"crds": CRDS[:4]}, "CRDMissing"),
    ({"crds": (*CRDS[:4], crd("TailnetGateway", "tailnetgateways", established=False))}, "CRDNotServed"),
    ({"deployment": None}, "OperatorMissing"),
    ({"deployment": {**DEPLOYMENT, "status": {"availableReplicas": 0}}}, "OperatorNotReady"),
    ({"lease": None}, "NoLeader"),
    ({"lease": {"spec": {**LEASE["spec"], "renewTime": iso(NOW - timedelta(minutes=5))}}}, "NoLeader"),
    ({"headscale": {"home": HeadscaleView(error="connection refused")}}, "HeadscaleUnreachable"),
    ({"headscale": {"home": HeadscaleView(nodes=(), policy="", version="v0.23.0")}}, "HeadscaleVersionUnsupported"),
    ({"tailnets": (tailnet(apiKey={}),)}, "NoWorkingKey"),
    ({"tailnets": (tailnet(apiKey={"prefix": "x", "expiresAt": iso(NOW - timedelta(days=1))}),)}, "KeyExpired"),
    ({"kubernetes_version": "v1.28.4"}, "KubernetesTooOld"),
    ({"cli_version": "0.2.0"}, "VersionSkew"),
])
def test_check_names_what_is_broken(changes: dict[str, Any], cause: str) -> None:
    report = check(check_facts(**changes))
    assert cause in report.causes(), report.render()
    assert report.check_next()


def test_check_with_no_tailnet_yet_passes() -> None:
    assert check(check_facts(tailnets=(), headscale={})).ok


def test_check_vouches_only_for_tailnets_whose_key_it_holds() -> None:
    elsewhere = HeadscaleView(error="no working key", no_key=True)
    assert check(check_facts(headscale={"home": elsewhere})).ok
    down = tailnet(conditions=[{"type": "Reachable", "status": "False", "reason": "Unreachable",
                                "message": "connection refused"}])
    report = check(check_facts(tailnets=(down,), headscale={"home": elsewhere}))
    assert report.causes() == ["HeadscaleUnreachable"]
    assert "connection refused" in report.render()
