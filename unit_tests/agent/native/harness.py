"""Two native DataPlanes wired back to back through an in-memory DERP relay."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from tailnet_agent import _native as nat

FRAME_SEND_PACKET = 0x04
FRAME_RECV_PACKET = 0x05
REGION = 999

A_V4, A_V6 = "100.64.0.1", "fd7a:115c:a1e0::1"
B_V4, B_V6 = "100.64.0.2", "fd7a:115c:a1e0::2"

ALLOW_ALL: list[nat.FilterRule] = [(["*"], [("*", 0, 65535)], [])]


def frame(frame_type: int, payload: bytes) -> bytes:
    return struct.pack(">BI", frame_type, len(payload)) + payload


def relay(buf: bytes, src_key: bytes) -> bytes:
    """What a DERP server does: SendPacket(dst key, pkt) becomes RecvPacket(src key, pkt)."""
    out: list[bytes] = []
    view = memoryview(buf)
    pos = 0
    while pos < len(buf):
        frame_type, length = struct.unpack_from(">BI", buf, pos)
        assert frame_type == FRAME_SEND_PACKET, f"unexpected client frame {frame_type:#x}"
        out.append(struct.pack(">BI", FRAME_RECV_PACKET, length))
        out.append(src_key)
        out.append(view[pos + 5 + 32 : pos + 5 + length].tobytes())
        pos += 5 + length
    return b"".join(out)


@dataclass
class Node:
    name: str
    dp: nat.DataPlane
    events: list[nat.Event] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


class Pair:
    """A (100.64.0.1) and B (100.64.0.2), each the other's only peer, both on REGION."""

    def __init__(self, clock: Callable[[], float], *, tcp_buffer_size: int | None = None) -> None:
        self.clock = clock
        kwargs = {} if tcp_buffer_size is None else {"tcp_buffer_size": tcp_buffer_size}
        self.a = Node("a", nat.DataPlane(os.urandom(32), **kwargs))
        self.b = Node("b", nat.DataPlane(os.urandom(32), **kwargs))
        self.a.dp.set_self([f"{A_V4}/32", f"{A_V6}/128"])
        self.b.dp.set_self([f"{B_V4}/32", f"{B_V6}/128"])
        self.a.dp.set_peers([(self.b.dp.public_key, [f"{B_V4}/32", f"{B_V6}/128"], REGION)])
        self.b.dp.set_peers([(self.a.dp.public_key, [f"{A_V4}/32", f"{A_V6}/128"], REGION)])
        self.a.dp.set_filter(ALLOW_ALL)
        self.b.dp.set_filter(ALLOW_ALL)

    def other(self, node: Node) -> Node:
        return self.b if node is self.a else self.a

    def step(self) -> list[tuple[Node, nat.Event]]:
        """Polls A then B, delivering each one's DERP writes to the other. Returns events."""
        happened: list[tuple[Node, nat.Event]] = []
        for node in (self.a, self.b):
            result = node.dp.poll(self.clock())
            node.counters = result.counters
            node.events.extend(result.events)
            happened.extend((node, e) for e in result.events)
            peer = self.other(node)
            for region, buf in result.derp_writes:
                assert region == REGION
                peer.dp.derp_feed(region, relay(buf, node.dp.public_key))
        return happened

    def run_until(self, done: Callable[[], bool], *, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if done():
                return
            self.step()
        raise AssertionError("condition not reached")

    def connect(self, port: int = 80) -> tuple[int, int]:
        """Opens A -> B:port; returns (handle on A, handle on B)."""
        listener = self.b.dp.tcp_listen(port)
        ha = self.a.dp.tcp_connect(B_V4, port)
        self.run_until(
            lambda: (
                any(isinstance(e, nat.Connected) and e.handle == ha for e in self.a.events)
                and any(isinstance(e, nat.Accepted) and e.listener == listener for e in self.b.events)
            )
        )
        accepted = [e for e in self.b.events if isinstance(e, nat.Accepted)]
        assert len(accepted) == 1
        self.a.events.clear()
        self.b.events.clear()
        return ha, accepted[0].handle


def ipv4_packet(proto: int, src: str, dst: str, payload: bytes = b"\x00" * 8) -> bytes:
    """A minimal IPv4 packet (checksum left zero: the receiver checks it only on transmit)."""
    header = struct.pack(
        ">BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(payload),
        0,
        0,
        64,
        proto,
        0,
        bytes(int(x) for x in src.split(".")),
        bytes(int(x) for x in dst.split(".")),
    )
    return header + payload
