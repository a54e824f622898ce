"""``diagnose`` from fetched objects: the target in every spelling, the consumer namespace rule,
the egress chain carried over, and its own causes."""

from __future__ import annotations

import pytest

from tailnet_operator.cli.diagnose import diagnose

from .builders import egress, facts, view

CLIENT = {"kind": "Pod", "metadata": {"name": "web-1", "namespace": "apps"}, "status": {"phase": "Running"}}


@pytest.mark.parametrize("target", ["ledger", "ledger.tailnet-system.svc", "ledger.tailnet-system.svc:5432",
                                    "db/ledger", "198.18.1.10", "198.18.1.10:5432"])
def test_diagnose_finds_the_target_in_every_spelling(target: str) -> None:
    report = diagnose(CLIENT, "apps/web-1", target, [egress()], {"db": facts()})
    assert report.ok, report.render()
    assert "kubectl exec -n apps web-1 -- nc -vz ledger.tailnet-system.svc 5432" in report.check_next()


def test_diagnose_names_a_namespace_outside_the_consumers() -> None:
    other = {**CLIENT, "metadata": {"name": "web-1", "namespace": "shop"}}
    report = diagnose(other, "shop/web-1", "ledger", [egress()], {"db": facts()})
    assert report.causes() == ["NamespaceNotAllowed"]
    assert "add shop to consumerNamespaces" in report.check_next()


def test_diagnose_carries_the_chain_of_the_targets_egress() -> None:
    broken = facts(headscale=view(policy='{"tagOwners": {"tag:egress-db": []}, "grants": []}'))
    report = diagnose(CLIENT, "apps/web-1", "ledger.tailnet-system.svc", [egress()], {"db": broken})
    assert report.causes() == ["NoGrant"]


def test_diagnose_an_unknown_target_lists_the_known_ones() -> None:
    report = diagnose(CLIENT, "apps/web-1", "payroll", [egress()], {"db": facts()})
    assert report.causes() == ["NoSuchTarget"]
    assert "ledger.tailnet-system.svc" in report.check_next()


def test_diagnose_a_missing_pod() -> None:
    assert diagnose(None, "apps/web-9", "ledger", [egress()], {}).causes() == ["PodNotFound"]
