"""Sans-IO decoder of the streamed ``/machine/map`` body.

Each message is a u32 **little-endian** length followed by that many bytes of MapResponse
(``controlclient/direct.go sendMapRequest`` reads ``binary.LittleEndian.Uint32``; Headscale's
``poll.go writeMap`` writes it). With ``Compress:""`` the bytes are plain JSON; the agent never
asks for zstd.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from .errors import ProtocolViolation

MAX_MAP_MESSAGE = 64 << 20
"""Bytes; a larger length prefix is treated as corruption."""


class MapFrameDecoder:
    """``feed(bytes)`` returns every complete, decoded MapResponse (a JSON object)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        out: list[dict[str, Any]] = []
        while len(self._buffer) >= 4:
            (size,) = struct.unpack_from("<I", self._buffer)
            if size > MAX_MAP_MESSAGE:
                raise ProtocolViolation(f"map message of {size} bytes exceeds {MAX_MAP_MESSAGE}")
            if len(self._buffer) < 4 + size:
                break
            raw = bytes(self._buffer[4:4 + size])
            del self._buffer[:4 + size]
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                raise ProtocolViolation("map message is not JSON (compressed?)") from exc
            except RecursionError as exc:
                raise ProtocolViolation("map message nests deeper than the decoder allows") from exc
            if not isinstance(doc, dict):
                raise ProtocolViolation("map message is not a JSON object")
            out.append(doc)
        return out

    @property
    def buffered(self) -> int:
        return len(self._buffer)


def encode_frame(message: dict[str, Any]) -> bytes:
    """The server side of the framing; for tests and fakes."""
    raw = json.dumps(message).encode()
    return struct.pack("<I", len(raw)) + raw
