"""The pydantic models: samples are valid, broken objects are not, and the wire format is camelCase."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from hack.crd_examples import INVALID_EXAMPLES, InvalidExample
from hack.crds import load_samples
from tailnet_operator.api import (
    Condition,
    TailnetEgressSpec,
    TailnetGateway,
    TailnetSiteSpec,
    TailnetSpec,
)
from tailnet_operator.api.common import parse_go_duration
from tailnet_operator.api.ingress import render_dns_template
from tailnet_operator.api.registry import KINDS, Kind, kind_of

SAMPLES = load_samples()


def test_one_sample_per_kind() -> None:
    assert sorted(s["kind"] for s in SAMPLES) == sorted(k.kind for k in KINDS)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s["kind"])
def test_sample_validates(sample: dict[str, object]) -> None:
    obj = kind_of(str(sample["kind"])).model.model_validate(sample)
    assert obj.model_dump(mode="json", exclude_none=True)["apiVersion"] == "tailnet.dev/v1alpha1"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.kind)
def test_at_least_three_invalid_examples_per_kind(kind: Kind) -> None:
    assert len([e for e in INVALID_EXAMPLES if e.kind == kind.kind]) >= 3


@pytest.mark.parametrize("example", INVALID_EXAMPLES, ids=lambda e: e.id)
def test_invalid_example_fails_validation(example: InvalidExample) -> None:
    """The same objects the apiserver must refuse (see e2e/test_crds.py) fail in Python too."""
    with pytest.raises(ValidationError) as info:
        kind_of(example.kind).model.model_validate(example.build())
    leaf = example.field.rsplit(".", 1)[-1].split("[", 1)[0]
    assert leaf in str(info.value)


def test_wire_names_are_camel_case_and_python_names_snake_case() -> None:
    spec = TailnetSpec(
        login_url="https://headscale.example.internal",
        bootstrap_key_secret_ref={"namespace": "tailnet-system", "name": "bootstrap"},
    )
    assert spec.to_wire() == {
        "loginURL": "https://headscale.example.internal",
        "bootstrapKeySecretRef": {"namespace": "tailnet-system", "name": "bootstrap", "key": "apiKey"},
        "apiKeyLifetime": "720h",
    }
    assert TailnetSpec.model_validate(spec.to_wire()) == spec


def test_defaults() -> None:
    site = TailnetSiteSpec.model_validate(
        {"tailnetRef": {"name": "hs"}, "routes": ["192.168.50.0/24"], "routerTag": "tag:site-a"}
    )
    assert site.routes == ["192.168.50.0/24"]
    gw = TailnetGateway.model_validate(
        {"spec": {"tailnetRef": {"name": "hs"}, "tag": "tag:gw", "image": "tailscale/tailscale:v1"}}
    )
    assert gw.spec.suspend is True
    assert gw.spec.deletion_policy == "Retain"
    egress = TailnetEgressSpec.model_validate(
        {
            "tailnetRef": {"name": "hs"},
            "tag": "tag:e",
            "consumerNamespaces": ["apps"],
            "targets": [{"name": "db", "address": "10.1.2.3", "ports": [{"port": 5432}]}],
        }
    )
    assert egress.targets[0].ports[0].protocol == "TCP"
    assert egress.replicas == 1, "one agent per egress unless asked (the specification's default)"


@pytest.mark.parametrize(
    ("tag", "ok"),
    [
        ("tag:web", True),
        ("tag:site-branch1", True),
        ("tag:a1", True),
        ("web", False),
        ("tag:", False),
        ("tag:Web", False),
        ("tag:1web", False),
        ("tag:web server", False),
        ("tag:web_1", False),
    ],
)
def test_tag_rule(tag: str, ok: bool) -> None:
    data = {"tailnetRef": {"name": "hs"}, "routes": ["10.0.0.0/24"], "routerTag": tag}
    if ok:
        TailnetSiteSpec.model_validate(data)
    else:
        with pytest.raises(ValidationError):
            TailnetSiteSpec.model_validate(data)


@pytest.mark.parametrize(
    ("route", "ok"),
    [
        ("192.168.50.0/24", True),
        ("192.168.60.5/32", True),
        ("fd7a:115c:a1e0:ab12::/64", True),
        ("192.168.50.0", False),
        ("192.168.50.1/24", False),
        ("192.168.50.0/33", False),
        ("0.0.0.0/0", False),
        ("::/0", False),
        ("branch1/24", False),
    ],
)
def test_cidr_rule(route: str, ok: bool) -> None:
    data = {"tailnetRef": {"name": "hs"}, "routes": [route], "routerTag": "tag:site"}
    if ok:
        TailnetSiteSpec.model_validate(data)
    else:
        with pytest.raises(ValidationError):
            TailnetSiteSpec.model_validate(data)


def test_ipv4_and_ipv6_routes_do_not_overlap_each_other() -> None:
    TailnetSiteSpec.model_validate(
        {"tailnetRef": {"name": "hs"}, "routes": ["10.0.0.0/8", "fd00::/8"], "routerTag": "tag:site"}
    )


def test_go_durations() -> None:
    assert parse_go_duration("720h") == 720 * 3600
    assert parse_go_duration("1h30m") == 5400
    assert parse_go_duration("1.5h") == 5400
    with pytest.raises(ValueError):
        parse_go_duration("90d")


def test_condition_times_are_rfc3339_utc() -> None:
    cond = Condition(
        type="Ready",
        status="True",
        reason="KeyValid",
        message="working key is valid",
        last_transition_time=datetime(2026, 1, 2, 4, 4, 5, 123456, tzinfo=timezone(timedelta(hours=1))),
        observed_generation=3,
    )
    assert cond.to_wire() == {
        "type": "Ready",
        "status": "True",
        "observedGeneration": 3,
        "lastTransitionTime": "2026-01-02T03:04:05Z",
        "reason": "KeyValid",
        "message": "working key is valid",
    }
    assert Condition.model_validate(cond.to_wire()).last_transition_time == datetime(
        2026, 1, 2, 3, 4, 5, tzinfo=UTC
    )


@pytest.mark.parametrize("reason", ["", "two words", "1Bad"])
def test_condition_reason_is_one_camel_case_word(reason: str) -> None:
    with pytest.raises(ValidationError):
        Condition(
            type="Ready", status="False", reason=reason, message="", last_transition_time=datetime.now(UTC)
        )


def test_status_parses_what_the_operator_writes() -> None:
    gw = TailnetGateway.model_validate(
        {
            "apiVersion": "tailnet.dev/v1alpha1",
            "kind": "TailnetGateway",
            "metadata": {"name": "gw", "generation": 2, "resourceVersion": "17", "labels": {"a": "b"}},
            "spec": {"tailnetRef": {"name": "hs"}, "tag": "tag:gw", "image": "tailscale/tailscale:v1"},
            "status": {
                "observedGeneration": 2,
                "receipts": {"nodeId": "7", "nodeKey": "nodekey:abc", "createdAt": "2026-01-02T03:04:05Z"},
            },
        }
    )
    assert gw.metadata.generation == 2
    assert gw.status is not None and gw.status.receipts is not None
    assert gw.status.receipts.node_id == "7"


def test_dns_template() -> None:
    assert render_dns_template(
        "{hostname}.apps.example.internal", hostname="grafana", name="o", namespace="m"
    ) == ("grafana.apps.example.internal")


def test_unknown_spec_fields_are_rejected() -> None:
    with pytest.raises(ValidationError, match="routerTags"):
        TailnetSiteSpec.model_validate(
            {
                "tailnetRef": {"name": "hs"},
                "routes": ["10.0.0.0/24"],
                "routerTags": "tag:site",
                "routerTag": "tag:s",
            }
        )


def _egress_with_address(address: str) -> dict[str, object]:
    sample = next(s for s in SAMPLES if s["kind"] == "TailnetEgress")
    spec = dict(sample["spec"])
    spec["targets"] = [{"name": "db", "address": address, "ports": [{"port": 5432}]}]
    return spec


@pytest.mark.parametrize("address", ["10.20.30.4", "db.branch1.example", "db1", "1a.example", "fd00::1", "0.0.0.0"])
def test_egress_address_accepts_ips_and_names(address: str) -> None:
    TailnetEgressSpec.model_validate(_egress_with_address(address))


@pytest.mark.parametrize("address", ["10.20.300.4", "10.20.30", "256.1.1.1", "1234", "10.0.0.01"])
def test_egress_address_refuses_names_whose_labels_are_all_numeric(address: str) -> None:
    with pytest.raises(ValidationError, match="labels are all numeric"):
        TailnetEgressSpec.model_validate(_egress_with_address(address))


@pytest.mark.parametrize("route", ["Ready", "NotAdvertised", "NotApproved", "NoGrant", "Unresolved", "Conflict",
                                   "Unknown"])
def test_every_route_state_the_egress_reconciler_writes_is_in_the_schema(route: str) -> None:
    from tailnet_operator.api.egress import EgressTargetStatus
    from tailnet_operator.controllers.egress_status import TargetState

    written = TargetState("ledger", "ledger.tailnet-system.svc", route, "why").status()
    assert EgressTargetStatus.model_validate(written).route == route
