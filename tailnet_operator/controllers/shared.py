"""Steps every reconciler of a tailnet node takes the same way: parsing the object and finding
its Tailnet, the working connection to Headscale, the tag pre-check against the live policy and
the bounded wait of a finalizer on Headscale."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tailnet_operator.api.tailnet import Tailnet
from tailnet_operator.policy import missing
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.runtime import Clock, Reader, Result
from tailnet_operator.types import JSON

from .access import Connection, HeadscaleAccess, NoAccess
from .conditions import Status

__all__ = ["FINALIZE_GIVE_UP", "NotReady", "parsed_with_tailnet", "still_trying", "tag_gap",
           "tag_not_owned_message", "working_connection"]

M = TypeVar("M", bound=BaseModel)

NotReady = Callable[[JSON, Status, str, str], Awaitable[None]]
"""Writes Ready (status, reason, message) on an object: each reconciler's own status writer."""

TAILNET_MISSING_RETRY = 30.0
WAITING_FOR_ACCESS_RETRY = 10.0


async def parsed_with_tailnet(reader: Reader, obj: JSON, model: type[M],
                              not_ready: NotReady) -> tuple[M, Tailnet] | Result:
    """``obj`` parsed as ``model`` with the Tailnet its ``spec.tailnetRef`` names; otherwise Ready
    says why (``InvalidSpec``, not retried; ``TailnetNotFound``, retried) and the Result to return."""
    try:
        parsed = model.model_validate(obj)
    except ValidationError as exc:
        await not_ready(obj, "False", "InvalidSpec", str(exc).splitlines()[0])
        return Result()
    name = str(parsed.spec.tailnet_ref.name)  # type: ignore[attr-defined]
    tailnet = reader.get(Tailnet, name)
    if tailnet is None:
        await not_ready(obj, "False", "TailnetNotFound", f"the Tailnet {name} does not exist")
        return Result(requeue_after=TAILNET_MISSING_RETRY)
    return parsed, tailnet


async def working_connection(access: HeadscaleAccess, obj: JSON, tailnet: Tailnet,
                             not_ready: NotReady) -> Connection | Result:
    """The Tailnet's Headscale with its working key; otherwise Ready is ``WaitingForAccess``."""
    try:
        return access.working(tailnet)
    except NoAccess as exc:
        await not_ready(obj, "Unknown", "WaitingForAccess", str(exc))
        return Result(requeue_after=WAITING_FOR_ACCESS_RETRY)

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
