"""docs/reference/metrics.md is generated from the registries: it fails when a metric changes
without the page being regenerated (python -m hack.metrics_doc)."""

from __future__ import annotations

from hack import metrics_doc


def test_the_metrics_reference_is_up_to_date() -> None:
    assert metrics_doc.PAGE.read_text() == metrics_doc.render(), "run python -m hack.metrics_doc"


def test_it_lists_the_metrics_the_alerts_and_dashboard_are_built_on() -> None:
    text = metrics_doc.render()
    for name in ("controller_runtime_reconcile_total", "tailnet_operator_build_info",
                 "tailnet_operator_controller_last_success_timestamp_seconds",
                 "tailnet_operator_resource_condition", "tailnet_operator_working_key_expiry_timestamp_seconds",
                 "tailnet_operator_preauth_key_expiry_timestamp_seconds",
                 "tailnet_operator_headscale_requests_total",
                 "tailnet_operator_headscale_request_duration_seconds",
                 "tailnet_operator_headscale_request_errors_total",
                 "tailnet_agent_control_connected"):
        assert f"| `{name}` |" in text, name
