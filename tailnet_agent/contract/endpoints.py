"""The agent's health server: one port for the kubelet's probes, the operator and Prometheus."""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_HEALTH_ADDRESS", "HEALTHZ_PATH", "HEALTH_PORT", "METRICS_PATH", "READYZ_PATH", "STATUS_PATH"]

HEALTH_PORT: Final = 9002
"""TCP port of ``/healthz``, ``/readyz``, ``/status`` and ``/metrics`` (the Service's port ``metrics``)."""
DEFAULT_HEALTH_ADDRESS: Final = f"0.0.0.0:{HEALTH_PORT}"
"""Where the agent listens when ``TAILNET_HEALTH_ADDRESS`` is unset."""
HEALTHZ_PATH: Final = "/healthz"
READYZ_PATH: Final = "/readyz"
STATUS_PATH: Final = "/status"
"""The JSON document of :mod:`tailnet_agent.contract.status`."""
METRICS_PATH: Final = "/metrics"
