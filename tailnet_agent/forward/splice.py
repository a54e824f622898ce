"""Copy bytes both ways between two stream pairs with half-close (Go's io.Copy plus CloseWrite).

When one side reaches EOF, ``write_eof`` goes to the other side and the opposite direction keeps
copying until it ends too; then both writers are closed. An error in either direction (a reset,
a write to a lost connection) aborts both connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

COPY_CHUNK = 256 << 10
"""Largest read per copy step: 256 KiB."""

Count = Callable[[int], None]


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: Count) -> None:
    while data := await src.read(COPY_CHUNK):
        dst.write(data)
        count(len(data))
        await dst.drain()
    if dst.can_write_eof() and not dst.is_closing():
        dst.write_eof()


async def splice(a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 b: tuple[asyncio.StreamReader, asyncio.StreamWriter], *,
                 count_a_to_b: Count = lambda n: None, count_b_to_a: Count = lambda n: None) -> None:
    """Forward ``a`` <-> ``b`` until both directions reached EOF; returns when both are closed.

    Raises ``OSError`` (e.g. ``ConnectionResetError``) after aborting both sides if one failed.
    """
    (a_reader, a_writer), (b_reader, b_writer) = a, b
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_pipe(a_reader, b_writer, count_a_to_b), name="splice-a-to-b")
            tg.create_task(_pipe(b_reader, a_writer, count_b_to_a), name="splice-b-to-a")
    except BaseExceptionGroup as group:
        a_writer.transport.abort()
        b_writer.transport.abort()
        errors = group.subgroup(lambda e: isinstance(e, OSError))
        if errors is not None and errors.exceptions and len(errors.exceptions) == len(group.exceptions):
            raise errors.exceptions[0] from None
        raise
    except BaseException:
        a_writer.transport.abort()
        b_writer.transport.abort()
        raise
    for writer in (a_writer, b_writer):
        writer.close()
    for writer in (a_writer, b_writer):
        with contextlib.suppress(OSError):
            await writer.wait_closed()
