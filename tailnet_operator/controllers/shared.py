"""Steps every reconciler of a tailnet node takes the same way: the tag pre-check against the
live policy and the bounded wait of a finalizer on Headscale."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from tailnet_operator.policy import missing
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.runtime import Clock
from tailnet_operator.types import JSON

__all__ = ["FINALIZE_GIVE_UP", "still_trying", "tag_gap", "tag_not_owned_message"]

FINALIZE_GIVE_UP = timedelta(minutes=5)
"""How long a finalizer retries Headscale before it lets the object go with a Warning Event."""


def tag_gap(live: str, tag: str, **objects: Any) -> str:
    """The snippet that would make the live policy own ``tag`` ("" when it does); ``objects`` are
    the CRs that need it, as :func:`~tailnet_operator.policy.adapters.derive_from_objects` takes them."""
    gap = missing(live or None, derive_from_objects(**objects))
    return gap.snippet if tag in gap.tags else ""


def tag_not_owned_message(tag: str, snippet: str) -> str:
    return (f"the live policy does not own {tag}; nothing was created on the tailnet. "
            f"Add this to the policy (or set spec.policy on the Tailnet to let the operator do it):\n{snippet}")


def still_trying(obj: JSON, clock: Clock, give_up: timedelta = FINALIZE_GIVE_UP) -> bool:
    """Whether ``obj`` has been deleting for less than ``give_up``."""
    deleted = datetime.fromisoformat(obj["metadata"]["deletionTimestamp"].replace("Z", "+00:00"))
    return clock.utcnow() - deleted < give_up
