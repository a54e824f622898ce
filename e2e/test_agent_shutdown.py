"""The agent's graceful shutdown, as the kubelet drives it: the real agent process (``python -m
tailnet_agent``, egress) against a real Headscale and a real tailscaled peer, stopped with SIGTERM
while a request is in flight.

Expected order: ``/readyz`` turns 503, the listener closes (a new connection is refused), the
request in flight completes, then the node logs out so Headscale deletes the ephemeral node at once
(its inactivity timeout here is 70 s), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from e2e.conftest import TailscaleFactory
from e2e.polling import eventually
from e2e.test_agent_egress import TAG, local_server, read_all, wait_peer_sees
from e2e.test_agent_ingress import hello, tcp
from hack.https_client import tunnel
from hack.localenv import Headscale, TailscaleNode, free_port

pytestmark = pytest.mark.integration

REPLY = b"x" * 200_000


async def readyz(port: int) -> int:
    return await asyncio.to_thread(_readyz, port)


def _readyz(port: int) -> int:
    """The status of ``/readyz`` (0: nothing listens)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_sigterm_drains_the_request_in_flight_then_logs_out(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-drain", headscale, authkey=key)
    arrived = asyncio.Event()
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError:  # the agent's reachability probe
            return
        arrived.set()
        await release.wait()
        writer.write(REPLY)
        await writer.drain()
        writer.close()

    async with local_server(slow) as port:
        listen, health = free_port(), free_port()
        (tmp_path / "key").write_text(key)
        env = {**os.environ, "AGENT_MODE": "egress", "TAILNET_CONTROL_URL": headscale.url,
               "TAILNET_AUTH_KEY_FILE": str(tmp_path / "key"), "TAILNET_HOSTNAME": "agent-drain",
               "TAILNET_CA_BUNDLE": str(headscale.ca_bundle), "TAILNET_BIND_ADDRESS": "127.0.0.1",
               "TAILNET_HEALTH_ADDRESS": f"127.0.0.1:{health}", "TAILNET_UDP_PORT": "off",
               "TAILNET_DRAIN_TIMEOUT": "60",
               "TAILNET_TARGETS": json.dumps([{"name": "slow", "address": peer.ipv4(),
                                               "ports": [{"port": port, "listen": listen}]}])}
        log = tmp_path / "agent.log"
        with log.open("wb") as out:
            agent = await asyncio.create_subprocess_exec(sys.executable, "-m", "tailnet_agent", env=env, cwd=tmp_path,
                                                         stdout=out, stderr=subprocess.STDOUT,
                                                         stdin=subprocess.DEVNULL)

        async def ready() -> bool:
            return await readyz(health) == 200 or agent.returncode is not None

        async def not_ready() -> bool:
            return await readyz(health) == 503

        try:
            await eventually(ready, timeout=60, what="the agent ready")
            assert agent.returncode is None, log.read_text()
            await wait_peer_sees(peer, "agent-drain")
            assert headscale.node_by_name("agent-drain") is not None

            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(b"in flight\n")
            await writer.drain()
            await asyncio.wait_for(arrived.wait(), 30)

            agent.send_signal(signal.SIGTERM)
            await eventually(not_ready, timeout=10, what="/readyz 503 after SIGTERM")
            await eventually(lambda: refused(listen), timeout=10, what="new connections refused")
            assert agent.returncode is None, "the agent exited with a request in flight"

            release.set()
            answer = await asyncio.wait_for(read_all(reader), 30)
            writer.close()
            assert answer == REPLY, f"{len(answer)} of {len(REPLY)} bytes"

            assert await asyncio.wait_for(agent.wait(), 30) == 0, log.read_text()
            await eventually(lambda: headscale.node_by_name("agent-drain") is None, timeout=10,
                             what="Headscale deleted the node (ephemeral inactivity timeout: 70 s)")
            assert "logged out" in log.read_text()
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()


async def answers(laptop: TailscaleNode, address: str, port: int) -> bool:
    """Whether a new connection from the laptop to ``address:port`` gets ``hello`` back."""
    try:
        reader, writer = await asyncio.wait_for(tunnel(laptop.http_proxy_port, address, port), 10)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(read_all(reader), 10)
        writer.close()
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
        return False
    return answer.endswith(b"hello\n")


async def test_sigterm_keeps_an_ingress_answering_until_its_name_is_handed_over(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """An ingress pod replaced while its successor starts (a deleted or evicted pod): peers still
    resolve its name to it, so after SIGTERM it keeps accepting until control renames its node (the
    operator hands the name to the successor), then closes its listeners and drains."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-hold", headscale, authkey=key)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    listen, health = free_port(), free_port()
    exposes = tmp_path / "exposes.json"
    exposes.write_text(json.dumps([tcp("web", listen, server.sockets[0].getsockname()[1])]))
    (tmp_path / "key").write_text(key)
    env = {**os.environ, "AGENT_MODE": "ingress", "TAILNET_CONTROL_URL": headscale.url,
           "TAILNET_AUTH_KEY_FILE": str(tmp_path / "key"), "TAILNET_HOSTNAME": "ingress-hold",
           "TAILNET_CA_BUNDLE": str(headscale.ca_bundle), "TAILNET_EXPOSES_FILE": str(exposes),
           "TAILNET_HEALTH_ADDRESS": f"127.0.0.1:{health}", "TAILNET_UDP_PORT": "off",
           "TAILNET_DRAIN_TIMEOUT": "90"}
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = await asyncio.create_subprocess_exec(sys.executable, "-m", "tailnet_agent", env=env, cwd=tmp_path,
                                                     stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        await eventually(lambda: _up(agent, health), timeout=60, what="the agent ready")
        assert agent.returncode is None, log.read_text()
        await wait_peer_sees(laptop, "ingress-hold")
        node = headscale.node_by_name("ingress-hold")
        assert node is not None
        address = next(a for a in node["ipAddresses"] if "." in a)
        assert await answers(laptop, address, listen)

        agent.send_signal(signal.SIGTERM)
        await eventually(lambda: _at(health, 503), timeout=10, what="/readyz 503 after SIGTERM")
        for _ in range(3):  # well past the moment a plain drain would have closed the listener
            assert await answers(laptop, address, listen), "refused while the node still holds the name"
        assert agent.returncode is None

        headscale.api("POST", f"/api/v1/node/{node['id']}/rename/ingress-hold-old{node['id']}")
        await eventually(lambda: _refused_over_tailnet(laptop, address, listen), timeout=30,
                         what="new connections refused once the name was handed over")
        assert await asyncio.wait_for(agent.wait(), 60) == 0, log.read_text()
        assert "served until the name was handed over" in log.read_text()
    finally:
        server.close()
        if agent.returncode is None:
            agent.kill()
            await agent.wait()


async def _up(agent: asyncio.subprocess.Process, health: int) -> bool:
    return await readyz(health) == 200 or agent.returncode is not None


async def _at(health: int, status: int) -> bool:
    return await readyz(health) == status


async def _refused_over_tailnet(laptop: TailscaleNode, address: str, port: int) -> bool:
    return not await answers(laptop, address, port)
