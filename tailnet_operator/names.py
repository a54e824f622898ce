"""Names and labels the operator gives what it makes, each defined once.

The builders that write an object and the code that finds it again (finalizers, the orphan
sweep, setup's watches, the CLI) read the same definition here, so the two cannot drift apart.
Changing a value renames objects in running clusters: the old ones would no longer be found.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["FINALIZER", "FINALIZER_FIELD_MANAGER", "LEADER_ELECTION_ID", "MANAGED_BY", "MANAGED_BY_LABEL", "OPERATOR",
           "TAILNET_LABEL", "agent_name", "auth_key_secret_name", "managed_by_operator", "policy_config_map_name",
           "working_key_secret_name"]

# -- finalizer ------------------------------------------------------------------------------

FINALIZER = "tailnet.dev/finalizer"
"""The operator's finalizer: present while it may still have to clean up outside state."""
FINALIZER_FIELD_MANAGER = "tailnet-operator-finalizer"
"""The field manager that owns the finalizer entry, and nothing else."""

LEADER_ELECTION_ID = "tailnet-operator"
"""The Lease the operator's replicas compete for, in the operator's namespace (the Role in
manifests/install allows that Lease name only)."""

# -- labels -----------------------------------------------------------------------------------

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
"""The label on every object the operator made; its value is :data:`OPERATOR`."""
OPERATOR = "tailnet-operator"
MANAGED_BY: Mapping[str, str] = MappingProxyType({MANAGED_BY_LABEL: OPERATOR})
"""The managed-by label as a selector: informers that watch only what the operator made use it."""
TAILNET_LABEL = "tailnet.dev/tailnet"
"""The Tailnet an object was made for (on objects that have no owner to say so, too)."""


def managed_by_operator(obj: Mapping[str, Any]) -> bool:
    """Whether ``obj`` carries the operator's managed-by label."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(MANAGED_BY_LABEL) == OPERATOR)


# -- pre-auth keys ----------------------------------------------------------------------------

_AUTH_KEY_SECRET_SUFFIX: Mapping[str, str] = MappingProxyType({
    "TailnetEgress": "-auth-key",  # no kind in it, unlike the others: renaming would lose existing keys
    "TailnetIngress": "-ingress-auth-key",
    "TailnetGateway": "-gateway-auth-key",
})


def auth_key_secret_name(kind: str, name: str) -> str:
    """The Secret holding the pre-auth key of the ``kind`` object ``name``.

    By name, not by parsed object: a CR being deleted may no longer parse. Where the Secret lives
    is the kind's own rule (beside the CR, or in the operator's or the gateway namespace).
    Raises ``ValueError`` for a kind that has no pre-auth key.
    """
    try:
        return f"{name}{_AUTH_KEY_SECRET_SUFFIX[kind]}"
    except KeyError:
        raise ValueError(f"{kind} has no pre-auth key") from None


# -- per Tailnet ------------------------------------------------------------------------------

def working_key_secret_name(tailnet: str) -> str:
    """The Secret in the operator's namespace that holds the Tailnet's working API key."""
    return f"{tailnet}-headscale-api-key"


def policy_config_map_name(tailnet: str) -> str:
    """The ConfigMap in the operator's namespace that holds the Tailnet's rendered policy."""
    return f"{tailnet}-policy"


# -- agents -----------------------------------------------------------------------------------

_AGENT_SUFFIX: Mapping[str, str] = MappingProxyType({
    "TailnetEgress": "-egress-agent",
    "TailnetIngress": "-ingress-agent",
})


def agent_name(kind: str, name: str) -> str:
    """The agent Deployment (and its status Service) of the ``kind`` object ``name``."""
    try:
        return f"{name}{_AGENT_SUFFIX[kind]}"
    except KeyError:
        raise ValueError(f"{kind} has no agent") from None
