"""Throughput and setup time through one path: the measurements every egress benchmark shares.

Standard library only, so the same file runs on this machine and, fed to ``python3 -``, inside a
client pod (the in-cluster benchmark) and on a site host (the server):

    python3 paths.py serve HOST PORT
    python3 paths.py round NAME DIAL [--mib 32] [--setups 0]      # one round; JSON on stdout

``DIAL`` is ``tcp:HOST:PORT`` or ``socks5:PROXY_HOST:PROXY_PORT:HOST:PORT``. The server speaks a
tiny protocol: ``U`` + u64 (read that many bytes, answer the count), ``D`` + u64 (send that many
bytes), ``E`` (echo one byte). No half-close: tailscaled's SOCKS5 proxy closes both ways on the
first EOF.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

Dial = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
CHUNK = 256 * 1024
MIB = 1024 * 1024
COLUMNS = ("one_stream_up_mbs", "one_stream_down_mbs", "eight_streams_up_mbs", "eight_streams_down_mbs")


# -- the server ---------------------------------------------------------------------------------


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One client of the sink/source server."""
    try:
        op = await reader.readexactly(1)
        if op == b"U":
            (size,) = struct.unpack("!Q", await reader.readexactly(8))
            total = 0
            while total < size and (data := await reader.read(min(CHUNK, size - total))):
                total += len(data)
            writer.write(struct.pack("!Q", total))
        elif op == b"D":
            (size,) = struct.unpack("!Q", await reader.readexactly(8))
            block = b"\0" * CHUNK
            while size > 0:
                writer.write(block[: min(size, CHUNK)])
                size -= min(size, CHUNK)
                await writer.drain()
        elif op == b"E":
            writer.write(await reader.readexactly(1))
        await writer.drain()
        await reader.read()  # hold until the client closes
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
        pass  # the client went away, or the benchmark is over
    finally:
        writer.close()


async def serve_forever(host: str, port: int) -> None:
    server = await asyncio.start_server(serve_connection, host, port)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


# -- the measurements ---------------------------------------------------------------------------


async def upload(dial: Dial, size: int) -> float:
    reader, writer = await dial()
    started = time.perf_counter()
    writer.write(b"U" + struct.pack("!Q", size))
    block = b"\1" * CHUNK
    sent = 0
    while sent < size:
        writer.write(block[: min(CHUNK, size - sent)])
        sent += min(CHUNK, size - sent)
        await writer.drain()
    (received,) = struct.unpack("!Q", await reader.readexactly(8))
    elapsed = time.perf_counter() - started
    writer.close()
    if received != size:
        raise RuntimeError(f"server received {received} of {size} bytes")
    return elapsed


async def download(dial: Dial, size: int) -> float:
    reader, writer = await dial()
    started = time.perf_counter()
    writer.write(b"D" + struct.pack("!Q", size))
    got = 0
    while got < size:
        data = await reader.read(CHUNK)
        if not data:
            raise RuntimeError(f"stream ended after {got} of {size} bytes")
        got += len(data)
    elapsed = time.perf_counter() - started
    writer.close()
    return elapsed


async def setup_times(dial: Dial, count: int) -> list[float]:
    """Seconds per connection: connect through the whole path plus one byte echoed."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        reader, writer = await dial()
        writer.write(b"E\x2a")
        await reader.readexactly(1)
        times.append(time.perf_counter() - started)
        writer.close()
    return times


@dataclass
class PathResult:
    name: str
    one_stream_up_mbs: float = 0.0
    one_stream_down_mbs: float = 0.0
    eight_streams_up_mbs: float = 0.0
    eight_streams_down_mbs: float = 0.0
    setup_p50_ms: float = 0.0
    setup_p99_ms: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)
    """Every round's figure per throughput column; the columns above are their medians."""
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.samples.setdefault(column, []).append(round(value, 2))
        setattr(self, column, statistics.median(self.samples[column]))

    def merge(self, other: PathResult) -> None:
        """Take the samples (and setup times, when measured) of another round of this path."""
        for column, values in other.samples.items():
            for value in values:
                self.add(column, value)
        if other.setup_p50_ms:
            self.setup_p50_ms, self.setup_p99_ms = other.setup_p50_ms, other.setup_p99_ms


async def throughput_round(result: PathResult, dial: Dial, *, mib: int) -> None:
    """One sample of each throughput column (8 streams share the ``mib``)."""
    size = mib * MIB
    result.add("one_stream_up_mbs", size / MIB / await upload(dial, size))
    result.add("one_stream_down_mbs", size / MIB / await download(dial, size))
    each = size // 8
    started = time.perf_counter()
    await asyncio.gather(*(upload(dial, each) for _ in range(8)))
    result.add("eight_streams_up_mbs", size / MIB / (time.perf_counter() - started))
    started = time.perf_counter()
    await asyncio.gather(*(download(dial, each) for _ in range(8)))
    result.add("eight_streams_down_mbs", size / MIB / (time.perf_counter() - started))


async def setup_round(result: PathResult, dial: Dial, *, setups: int) -> None:
    times = sorted(await setup_times(dial, setups))
    result.setup_p50_ms = statistics.median(times) * 1000
    result.setup_p99_ms = times[min(len(times) - 1, int(len(times) * 0.99))] * 1000


# -- dialers ------------------------------------------------------------------------------------


def socks5_dialer(proxy_host: str, proxy_port: int, host: str, port: int) -> Dial:
    """Dial ``host:port`` through a SOCKS5 proxy (tailscaled's userspace netstack)."""

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(proxy_host, proxy_port)
        writer.write(b"\x05\x01\x00")
        await reader.readexactly(2)
        writer.write(b"\x05\x01\x00\x01" + ipaddress.IPv4Address(host).packed + struct.pack("!H", port))
        reply = await reader.readexactly(10)
        if reply[1] != 0:
            writer.close()
            raise ConnectionError(f"SOCKS5 connect to {host}:{port} failed with code {reply[1]}")
        return reader, writer

    return dial


def tcp_dialer(host: str, port: int) -> Dial:
    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port)

    return dial


def parse_dial(spec: str) -> Dial:
    """``tcp:HOST:PORT`` or ``socks5:PROXY_HOST:PROXY_PORT:HOST:PORT``."""
    kind, *parts = spec.split(":")
    if kind == "tcp" and len(parts) == 2:
        return tcp_dialer(parts[0], int(parts[1]))
    if kind == "socks5" and len(parts) == 4:
        return socks5_dialer(parts[0], int(parts[1]), parts[2], int(parts[3]))
    raise ValueError(f"not a dial spec: {spec!r} (tcp:HOST:PORT or socks5:PROXY_HOST:PROXY_PORT:HOST:PORT)")


async def one_round(name: str, dial: Dial, *, mib: int, setups: int) -> PathResult:
    """A warm-up, one throughput round and, with ``setups``, the setup times."""
    result = PathResult(name)
    await upload(dial, MIB)
    if mib:
        await throughput_round(result, dial, mib=mib)
    if setups:
        await setup_round(result, dial, setups=setups)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the sink/source server")
    serve.add_argument("host")
    serve.add_argument("port", type=int)
    measure = commands.add_parser("round", help="one round through one path; JSON on stdout")
    measure.add_argument("name")
    measure.add_argument("dial")
    measure.add_argument("--mib", type=int, default=32)
    measure.add_argument("--setups", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        asyncio.run(serve_forever(args.host, args.port))
        return 0
    result = asyncio.run(one_round(args.name, parse_dial(args.dial), mib=args.mib, setups=args.setups))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
