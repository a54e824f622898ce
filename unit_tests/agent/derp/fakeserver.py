"""A minimal in-process DERP server (plain TCP) built from the server-side codec helpers.

It speaks just enough for the client tests: the 101 upgrade, ServerKey, ClientInfo (opened and
recorded), ServerInfo, and then records every frame it receives. It does not relay packets;
tests inject frames with :meth:`FakeDerpServer.send`. ``admit`` False mimics a server that
verifies clients and rejects the key (it closes after ClientInfo).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from hack import derp_codec as codec
from tailnet_agent.derp import frames as f


class FakeDerpServer:
    def __init__(self, *, admit: bool = True, status_line: str = "HTTP/1.1 101 Switching Protocols",
                 after_server_info: bytes = b"") -> None:
        self.private_key = os.urandom(32)
        self.public_key = f.public_key_of(self.private_key)
        self.admit = admit
        self.status_line = status_line
        self.after_server_info = after_server_info
        self.port = 0
        self.requests: list[bytes] = []
        self.client_infos: list[tuple[bytes, f.ClientInfo]] = []
        self.received: list[f.Frame] = []
        self.connections = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self._frame_arrived = asyncio.Event()

    async def __aenter__(self) -> FakeDerpServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drop_all()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def send(self, data: bytes) -> None:
        """Write raw bytes to the newest client connection."""
        writer = self._writers[-1]
        writer.write(data)
        await writer.drain()

    async def drop_all(self) -> None:
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        self._writers.clear()

    async def wait_frames(self, count: int, *, timeout: float = 5.0) -> list[f.Frame]:
        async with asyncio.timeout(timeout):
            while len(self.received) < count:
                self._frame_arrived.clear()
                await self._frame_arrived.wait()
        return self.received

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(head)
            writer.write(f"{self.status_line}\r\nUpgrade: DERP\r\nConnection: Upgrade\r\n"
                         f"Derp-Version: 2\r\n\r\n".encode())
            if self.status_line.split()[1] != "101":
                writer.close()
                return
            writer.write(codec.encode_server_key(self.public_key))
            await writer.drain()
            decoder = f.FrameDecoder()
            client_key = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                for frame in decoder.feed(data):
                    if not client_key:
                        client_key, info = codec.parse_client_info(self.private_key, frame)
                        self.client_infos.append((client_key, info))
                        if not self.admit:
                            writer.close()
                            return
                        writer.write(codec.encode_server_info(self.private_key, client_key) + self.after_server_info)
                        await writer.drain()
                        continue
                    self.received.append(frame)
                    self._frame_arrived.set()
        except (OSError, asyncio.IncompleteReadError):
            return
