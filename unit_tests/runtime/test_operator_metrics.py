"""The operator's own metrics: build info, the cache-derived state-set and key expiry, the Headscale
API metrics as the client reports them, and the last-success timestamp per controller."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from tailnet_operator.headscale import ConnectError, HeadscaleClient, MockTransport, Request, Response, ServerError
from tailnet_operator.monitoring import HeadscaleMetrics, StateCollector, normalize_path, register_build_info
from tailnet_operator.runtime.metrics import ControllerMetrics


def lines(registry: CollectorRegistry) -> list[str]:
    return generate_latest(registry).decode().splitlines()


def test_build_info_names_version_and_revision() -> None:
    registry = CollectorRegistry()
    register_build_info(registry, revision="abc123")
    [line] = [x for x in lines(registry) if x.startswith("tailnet_operator_build_info{")]
    assert 'revision="abc123"' in line and 'version="0.1.0"' in line and line.endswith(" 1.0")


OBJECTS: dict[str, list[dict[str, Any]]] = {
    "Tailnet": [{"metadata": {"name": "home"}, "status": {
        "conditions": [{"type": "Ready", "status": "False", "reason": "Unreachable"},
                       {"type": "PolicyApplied", "status": "False", "reason": "PolicyRejected"}],
        "apiKey": {"expiresAt": "2026-12-01T00:00:00Z"}}}],
    "TailnetEgress": [{"metadata": {"name": "db", "namespace": "tailnet-system"}, "status": {
        "conditions": [{"type": "Ready", "status": "True", "reason": "Ready"}],
        "preAuthKey": {"expiresAt": "2026-12-01T12:00:00+00:00"}}},
        {"metadata": {"name": "new", "namespace": "tailnet-system"}}],
}


def test_the_state_collector_exports_a_state_set_reasons_and_key_expiry() -> None:
    def lister(kind: str) -> list[dict[str, Any]]:
        if kind not in OBJECTS:
            raise KeyError(kind)  # a kind the cache does not hold: skipped, not a failed scrape
        return OBJECTS[kind]

    registry = CollectorRegistry()
    registry.register(StateCollector(lister, ["Tailnet", "TailnetEgress", "TailnetSite"]))
    text = lines(registry)
    for line in (
        'tailnet_operator_resource_condition{condition="Ready",kind="Tailnet",name="home",namespace="",'
        'status="True"} 0.0',
        'tailnet_operator_resource_condition{condition="Ready",kind="Tailnet",name="home",namespace="",'
        'status="False"} 1.0',
        'tailnet_operator_resource_condition{condition="Ready",kind="Tailnet",name="home",namespace="",'
        'status="Unknown"} 0.0',
        'tailnet_operator_resource_condition_reason{condition="PolicyApplied",kind="Tailnet",name="home",namespace="",'
        'reason="PolicyRejected"} 1.0',
        'tailnet_operator_resource_condition{condition="Ready",kind="TailnetEgress",name="db",namespace="tailnet-system",'
        'status="True"} 1.0',
        'tailnet_operator_working_key_expiry_timestamp_seconds{tailnet="home"} 1.7960832e+09',
        'tailnet_operator_preauth_key_expiry_timestamp_seconds{kind="TailnetEgress",name="db",namespace="tailnet-system"}'
        ' 1.7961264e+09',
    ):
        assert line in text, (line, text)
    assert not any('name="new"' in x for x in text)


def test_headscale_paths_are_bounded() -> None:
    assert normalize_path("/api/v1/node/17/approve_routes") == "/api/v1/node/{id}/approve_routes"
    assert normalize_path("/api/v1/node?user=x") == "/api/v1/node"
    assert normalize_path("/api/v1/apikey/expire") == "/api/v1/apikey/expire"
    assert normalize_path("/api/v1/apikey/hsk_abc") == "/api/v1/apikey/{id}"


async def test_the_client_reports_every_attempt_with_its_code() -> None:
    registry = CollectorRegistry()
    metrics = HeadscaleMetrics(registry=registry)
    answers = iter([Response(503, body=b'{"message": "busy"}'), Response(200, body=b'{"node": {"id": "4"}}')])

    def handler(request: Request) -> Response:
        if request.url.endswith("/api/v1/node/5"):
            raise ConnectError("refused")
        return next(answers)

    async with HeadscaleClient("https://hs.test", "k", transport=MockTransport(handler), backoff=0,
                               observer=metrics) as hs:
        await hs.get_node(4)
        with contextlib.suppress(ConnectError, ServerError):
            await hs.get_node(5)
    text = lines(registry)
    assert ('tailnet_operator_headscale_requests_total{code="503",method="GET",path="/api/v1/node/{id}"} 1.0'
            in text), text
    assert 'tailnet_operator_headscale_requests_total{code="200",method="GET",path="/api/v1/node/{id}"} 1.0' in text
    assert any(x.startswith('tailnet_operator_headscale_requests_total{code="<error>",method="GET"') for x in text)
    errors = [x for x in text if x.startswith("tailnet_operator_headscale_request_errors_total{")]
    assert errors and float(errors[0].rsplit(" ", 1)[1]) >= 2.0, errors  # the 503 and each refused attempt
    assert any(x.startswith("tailnet_operator_headscale_request_duration_seconds_count{") for x in text)


def test_last_success_moves_on_success_only() -> None:
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry=registry)
    metrics.reconciled("egress", "success", 0.1, at=1000.0)
    metrics.reconciled("egress", "error", 0.1, at=2000.0)
    metrics.reconciled("egress", "requeue_after", 0.1, at=3000.0)
    metrics.reconciled("egress", "error", 0.1, at=4000.0)
    assert ('tailnet_operator_controller_last_success_timestamp_seconds{controller="egress"} 3000.0'
            in lines(registry))
