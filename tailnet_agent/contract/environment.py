"""The environment of the agent's container: the variable names and the modes.

The operator sets these on every agent Deployment (``tailnet_operator.resources.agent``); the
agent reads them at startup (``tailnet_agent.config``, whose docstring gives each one's meaning
and default). One spelling here keeps the two from drifting.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ACCEPT_ROUTES",
    "AGENT_MODE",
    "AUTH_KEY_FILE",
    "BIND_ADDRESS",
    "CA_BUNDLE",
    "CONTROL_URL",
    "DIAL_TIMEOUT",
    "DRAIN_TIMEOUT",
    "EGRESS",
    "EXPOSES_FILE",
    "HEALTH_ADDRESS",
    "HOSTNAME",
    "HTTP1_MAX_FIELD_SIZE",
    "HTTP1_MAX_LINE_SIZE",
    "HTTP2_MAX_HEADER_LIST_SIZE",
    "HTTP2_MAX_RESETS",
    "HTTP2_MAX_STREAMS",
    "IDLE_TIMEOUT",
    "INGRESS",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_PEER",
    "MODES",
    "SHARED_ADDRESS",
    "TARGETS",
    "TARGETS_FILE",
    "UDP_PORT",
]

AGENT_MODE: Final = "AGENT_MODE"
"""The direction, one of :data:`MODES`; no default (the agent exits 2 without it)."""
EGRESS: Final = "egress"
INGRESS: Final = "ingress"
MODES: Final = (EGRESS, INGRESS)

CONTROL_URL: Final = "TAILNET_CONTROL_URL"
AUTH_KEY_FILE: Final = "TAILNET_AUTH_KEY_FILE"
HOSTNAME: Final = "TAILNET_HOSTNAME"
CA_BUNDLE: Final = "TAILNET_CA_BUNDLE"
TARGETS: Final = "TAILNET_TARGETS"
TARGETS_FILE: Final = "TAILNET_TARGETS_FILE"
EXPOSES_FILE: Final = "TAILNET_EXPOSES_FILE"
BIND_ADDRESS: Final = "TAILNET_BIND_ADDRESS"
HEALTH_ADDRESS: Final = "TAILNET_HEALTH_ADDRESS"
ACCEPT_ROUTES: Final = "TAILNET_ACCEPT_ROUTES"
DIAL_TIMEOUT: Final = "TAILNET_DIAL_TIMEOUT"
UDP_PORT: Final = "TAILNET_UDP_PORT"
MAX_CONNECTIONS: Final = "TAILNET_MAX_CONNECTIONS"
MAX_CONNECTIONS_PER_PEER: Final = "TAILNET_MAX_CONNECTIONS_PER_PEER"
HTTP1_MAX_LINE_SIZE: Final = "TAILNET_HTTP1_MAX_LINE_SIZE"
HTTP1_MAX_FIELD_SIZE: Final = "TAILNET_HTTP1_MAX_FIELD_SIZE"
HTTP2_MAX_HEADER_LIST_SIZE: Final = "TAILNET_HTTP2_MAX_HEADER_LIST_SIZE"
HTTP2_MAX_STREAMS: Final = "TAILNET_HTTP2_MAX_STREAMS"
HTTP2_MAX_RESETS: Final = "TAILNET_HTTP2_MAX_RESETS"
IDLE_TIMEOUT: Final = "TAILNET_IDLE_TIMEOUT"
DRAIN_TIMEOUT: Final = "TAILNET_DRAIN_TIMEOUT"
SHARED_ADDRESS: Final = "TAILNET_SHARED_ADDRESS"
"""An ingress's address shared by its replicas, advertised by each as a route (ingress only)."""
LOG_FORMAT: Final = "TAILNET_LOG_FORMAT"
"""``json`` for JSON lines; anything else (or unset): console lines."""
LOG_LEVEL: Final = "TAILNET_LOG_LEVEL"
"""A logging level name; unset: ``info``."""
