"""Waiting for a condition with a deadline: the only way tests here wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def eventually(check: Callable[[], Any], *, timeout: float = 30.0, interval: float = 0.1,
                     what: str = "condition") -> Any:
    """Poll ``check`` (sync, or returning an awaitable) until it gives something truthy; return it.

    Fails with an AssertionError naming ``what`` and the last value after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        result = check()
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await result
        if result:
            return result
        last = result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)
