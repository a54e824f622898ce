"""The versions of one Lease, in the order the apiserver wrote them.

Tests of leader election check *what happened* to the Lease (a release before a takeover, one
transition) from its watch, instead of how many seconds a takeover took: a loaded machine makes
any time window flaky, and the timings belong to the benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.errors import Conflict
from tailnet_operator.runtime.kinds import LEASE

from .polling import eventually


@dataclass
class LeaseHistory:
    """Every spec the Lease had since :func:`lease_history` began, oldest first."""

    specs: list[dict[str, Any]] = field(default_factory=list)

    def holders(self) -> list[str]:
        """The holder of each version, consecutive repeats folded (a release shows as "")."""
        folded: list[str] = []
        for spec in self.specs:
            holder = str(spec.get("holderIdentity") or "")
            if not folded or folded[-1] != holder:
                folded.append(holder)
        return folded


@contextlib.asynccontextmanager
async def lease_history(client: Client, name: str, namespace: str) -> AsyncIterator[LeaseHistory]:
    """Record the Lease's versions from its current one on, while the block runs."""
    current = await client.get(LEASE, name, namespace)
    history = LeaseHistory([current.get("spec", {})])
    ready = asyncio.Event()

    async def follow() -> None:
        rv = current["metadata"]["resourceVersion"]
        ready.set()
        async for event in client.watch(LEASE, namespace, resource_version=rv,
                                        field_selector=f"metadata.name={name}", bookmarks=False):
            if event.type in ("ADDED", "MODIFIED"):
                history.specs.append(event.object.get("spec", {}))

    task = asyncio.create_task(follow())
    await ready.wait()
    try:
        yield history
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def hijack(client: Client, name: str, namespace: str, holder: str, *, timeout: float = 30.0) -> None:
    """Write another holder into the Lease, as a rival that ignores the protocol would: read, change,
    replace, again on a Conflict (the leader renews in between), until ``timeout``."""
    async def replaced() -> bool:
        lease = await client.get(LEASE, name, namespace)
        lease["spec"]["holderIdentity"] = holder
        try:
            await client.replace(LEASE, lease)
        except Conflict:
            return False
        return True

    await eventually(replaced, timeout=timeout, interval=0.05, what=f"{holder} written into the Lease {name}")
