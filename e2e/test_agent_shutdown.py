"""The agent's graceful shutdown, as the kubelet drives it: the real agent process (``python -m
tailnet_agent``, egress) against a real Headscale and a real tailscaled peer, stopped with SIGTERM
while a request is in flight.

Expected order: ``/readyz`` turns 503; a client that still connects (a kube-proxy with no other
endpoint, or a late one, sends it) is served; once none has come for a while the listener closes (a
new connection is refused); the requests in flight complete, then the node logs out so Headscale
deletes the ephemeral node at once (its inactivity timeout here is 70 s), and the process exits 0.
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
from collections.abc import Mapping
from pathlib import Path

import pytest

from e2e.conftest import TailscaleFactory
from e2e.disruption import streak
from e2e.polling import eventually
from e2e.test_agent_egress import TAG, local_server, read_all, wait_peer_sees
from e2e.test_agent_ingress import hello, tcp
from hack.https_client import tunnel
from hack.localenv import BASE_DOMAIN, Headscale, TailscaleNode, free_port
from tailnet_agent.handover import QUIET
from tailnet_operator.headscale import HeadscaleClient

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


async def request(port: int, line: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(line)
    await writer.drain()
    return reader, writer


async def test_sigterm_serves_who_still_comes_drains_the_requests_in_flight_then_logs_out(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-drain", headscale, authkey=key)
    arrived: list[bytes] = []
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            arrived.append(await reader.readuntil(b"\n"))
        except asyncio.IncompleteReadError:  # the agent's reachability probe, or a refusal check
            writer.close()
            return
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

            first = await request(listen, b"in flight\n")
            await eventually(lambda: arrived == [b"in flight\n"], timeout=30, what="the first request at the server")

            agent.send_signal(signal.SIGTERM)
            await eventually(not_ready, timeout=10, what="/readyz 503 after SIGTERM")
            late = await request(listen, b"after SIGTERM\n")
            await eventually(lambda: b"after SIGTERM\n" in arrived, timeout=30,
                             what="a client that connected after SIGTERM forwarded, not refused")
            # Looked for less often than the agent's quiet time: each look is a client too.
            await eventually(lambda: refused(listen), timeout=30, interval=QUIET + 1,
                             what="new connections refused once none came")
            assert agent.returncode is None, "the agent exited with requests in flight"

            release.set()
            for reader, writer in (first, late):
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
    listen = free_port()
    agent = await IngressProcess.start(tmp_path, headscale, key, "ingress-hold", listen,
                                       server.sockets[0].getsockname()[1])
    try:
        await eventually(lambda: _up(agent.process, agent.health), timeout=60, what="the agent ready")
        assert agent.process.returncode is None, agent.log.read_text()
        await wait_peer_sees(laptop, "ingress-hold")
        node = headscale.node_by_name("ingress-hold")
        assert node is not None
        address = next(a for a in node["ipAddresses"] if "." in a)
        assert await answers(laptop, address, listen)

        agent.process.send_signal(signal.SIGTERM)
        await eventually(lambda: _at(agent.health, 503), timeout=10, what="/readyz 503 after SIGTERM")
        for _ in range(3):  # well past the moment a plain drain would have closed the listener
            assert await answers(laptop, address, listen), "refused while the node still holds the name"
        assert agent.process.returncode is None

        headscale.api("POST", f"/api/v1/node/{node['id']}/rename/ingress-hold-old{node['id']}")
        await eventually(lambda: _refused_over_tailnet(laptop, address, listen), timeout=30,
                         what="new connections refused once the name was handed over")
        assert await asyncio.wait_for(agent.process.wait(), 60) == 0, agent.log.read_text()
        assert "served until the name was handed over" in agent.log.read_text()
    finally:
        server.close()
        await agent.kill()


async def test_a_name_handed_over_to_a_successor_loses_no_request_made_by_name(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """The operator's hand-over as a peer sees it: requests by MagicDNS name every 20 ms, each a new
    connection with a 2 s deadline, while the old agent is told to stop and its name moves to the
    successor (both renamed together, as the operator does: ``HeadscaleClient.rename_nodes``). Peers learn the
    rename from their own netmaps, later than the old node does: none of their requests may be
    refused or hang past its deadline meanwhile. What Headscale adds (no node of the name between
    the two renames, in one map update of the laptop's) is counted, not failed."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-handover", headscale, authkey=key)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    backend, listen = server.sockets[0].getsockname()[1], free_port()
    agents = [await IngressProcess.start(tmp_path / "old", headscale, key, "ingress-hand", listen, backend)]
    load: Load | None = None
    try:
        await eventually(lambda: _up(agents[0].process, agents[0].health), timeout=60, what="the old agent ready")
        old = headscale.node_by_name("ingress-hand")
        assert old is not None
        await wait_peer_sees(laptop, "ingress-hand")
        load = Load(laptop, f"ingress-hand.{BASE_DOMAIN}", listen)
        await eventually(lambda: load.streak() >= 10, timeout=30, what="the load answered by name")

        agents.append(await IngressProcess.start(tmp_path / "new", headscale, key, "ingress-hand", listen, backend))
        await eventually(lambda: _up(agents[1].process, agents[1].health), timeout=60, what="the new agent ready")
        assert agents[1].process.returncode is None, agents[1].log.read_text()
        new = next(n for n in headscale.nodes() if n["id"] != old["id"] and n.get("name") == "ingress-hand")
        await eventually(lambda: asyncio.to_thread(lambda: sum(p.get("HostName") == "ingress-hand"
                                                               for p in laptop.peers()) == 2),
                         timeout=30, what="the laptop sees both nodes")

        agents[0].process.send_signal(signal.SIGTERM)
        await eventually(lambda: _at(agents[0].health, 503), timeout=10, what="the old agent's /readyz 503")
        renamed_at = asyncio.get_running_loop().time() - load.results[0][0]
        async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hs:
            renamed = await hs.rename_nodes([(old["id"], f"ingress-hand-old{old['id']}")], (new["id"], "ingress-hand"),
                                            last_name=new["givenName"])
        assert [(n.id, n.given_name) for n in renamed] == [(old["id"], f"ingress-hand-old{old['id']}"),
                                                           (new["id"], "ingress-hand")]
        assert await asyncio.wait_for(agents[0].process.wait(), 60) == 0, agents[0].log.read_text()
        await eventually(lambda: load.streak() >= 50, timeout=30, what="50 answers in a row after the old agent left")
        outcomes = load.stop()
        refused = {at: why for at, why in outcomes.items() if why not in (UNRESOLVED, UNANSWERED)}
        assert not refused, f"requests by name refused during the hand-over: {refused}"
        hung = {at: why for at, why in outcomes.items() if why == UNANSWERED}
        assert not hung, f"requests by name hung past {LOAD_DEADLINE} s (rename at {renamed_at:.2f} s): {hung}"
        print(f"\nof {load.sent()} requests by name, {sum(w == UNRESOLVED for w in outcomes.values())} found no node "
              "of that name between Headscale's two renames, and "
              f"{sum(w == UNANSWERED for w in outcomes.values())} went unanswered (docs/decisions.md)")
    finally:
        await tear_down(load, server, agents)


PORT_REUSE_STREAMS, PORT_REUSE_REQUESTS = 3, 1000
"""Streams of requests by name side by side, and requests each, in
:func:`test_no_request_by_name_hangs_on_a_source_port_the_agent_closed_first`: three streams keep
three times as many of the agent's connections in TIME-WAIT, where one stream of 1,000 hung 1 or 2."""


async def test_no_request_by_name_hangs_on_a_source_port_the_agent_closed_first(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    """A backend that closes first (``hello``) leaves each of the agent's connections in TIME-WAIT
    for 10 s, about 500 per stream of 50 requests a second, and the laptop's userspace tailscaled
    picks each source port at random, so now and then it dials from the port of one of them. The
    agent's TCP stack gave that SYN to the socket in TIME-WAIT, which dropped it and each
    retransmission (1 s, 3 s) until TIME-WAIT ran out: the request hung past its 2 s deadline,
    with no hand-over or peer change at all (docs/decisions.md, issue 24). None may."""
    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    laptop = tailscale_nodes("ts-laptop-reuse", headscale, authkey=key)
    server = await asyncio.start_server(hello, "127.0.0.1", 0)
    backend, listen = server.sockets[0].getsockname()[1], free_port()
    agents = [await IngressProcess.start(tmp_path, headscale, key, "ingress-reuse", listen, backend)]
    loads: list[Load] = []
    try:
        await eventually(lambda: _up(agents[0].process, agents[0].health), timeout=60, what="the agent ready")
        assert agents[0].process.returncode is None, agents[0].log.read_text()
        await wait_peer_sees(laptop, "ingress-reuse")
        loads = [Load(laptop, f"ingress-reuse.{BASE_DOMAIN}", listen) for _ in range(PORT_REUSE_STREAMS)]
        await eventually(lambda: all(load.streak() >= 10 for load in loads), timeout=30,
                         what="the loads answered by name")
        marked = [(load, load.sent()) for load in loads]
        await eventually(lambda: all(load.sent() - mark >= PORT_REUSE_REQUESTS for load, mark in marked),
                         timeout=180, what=f"{PORT_REUSE_REQUESTS} requests by name in each stream")
        first = min(load.results[mark][0] for load, mark in marked)
        failed = sorted((round(at - first, 2), why) for load, mark in marked
                        for at, why in load.results[mark:] if why is not None)
        sent = sum(load.sent() - mark for load, mark in marked)
        print(f"\nof {sent} requests by name to one agent in {len(loads)} streams, {len(failed)} failed")
        assert not failed, f"of {sent} requests by name (seconds after the first, why): {failed}"
    finally:
        for load in loads[1:]:
            load.stop()
        await tear_down(loads[0] if loads else None, server, agents)


async def tear_down(load: Load | None, server: asyncio.Server, agents: list[IngressProcess]) -> None:
    """Stop the load, the backend and every agent process left (a test's ``finally``)."""
    if load is not None:
        load.stop()
    server.close()
    for agent in agents:
        await agent.kill()


LOAD_INTERVAL, LOAD_DEADLINE = 0.02, 2.0


UNRESOLVED = "no node of that name"
"""Why a request failed when the laptop's tailscaled found no node of the name (its dialer then asks
the host's resolver, which knows nothing of the tailnet)."""
UNANSWERED = "no answer within the deadline"
"""A request that hung: its SYN was dropped (before the fix, by a socket of the agent's in TIME-WAIT
on the same source port: :func:`test_no_request_by_name_hangs_on_a_source_port_the_agent_closed_first`);
the old node refusing would be ``refused``, not this."""


class Load:
    """New connections from the laptop to ``name:port`` every :data:`LOAD_INTERVAL`, each answered
    within :data:`LOAD_DEADLINE` or failed."""

    def __init__(self, laptop: TailscaleNode, name: str, port: int) -> None:
        self.laptop, self.name, self.port = laptop, name, port
        self.results: list[tuple[float, str | None]] = []
        """When each request started and why it failed (None: answered)."""
        self._task = asyncio.create_task(self._run())

    async def _one(self) -> str | None:
        reader, writer = await tunnel(self.laptop.http_proxy_port, self.name, self.port)
        try:
            writer.write(b"GET / HTTP/1.0\r\n\r\n")
            await writer.drain()
            return None if (await read_all(reader)).endswith(b"hello\n") else "a wrong answer"
        finally:
            writer.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            try:
                why = await asyncio.wait_for(self._one(), LOAD_DEADLINE)
            except TimeoutError:
                why = UNANSWERED
            except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
                why = UNRESOLVED if "no such host" in str(exc) else f"{type(exc).__name__}: {exc}"[:200]
            self.results.append((start, why))
            await asyncio.sleep(max(0.0, start + LOAD_INTERVAL - loop.time()))

    def sent(self) -> int:
        return len(self.results)

    def streak(self) -> int:
        """Answers in a row at the end."""
        return streak([(at, at, why is None) for at, why in self.results])

    def stop(self) -> dict[float, str]:
        """Stop; each failed request by when it started (seconds after the first) with why."""
        self._task.cancel()
        first = self.results[0][0] if self.results else 0.0
        return {round(at - first, 2): why for at, why in self.results if why is not None}


def _ingress_environment(workdir: Path, headscale: Headscale, key: str, hostname: str, listen: int, backend: int,
                         health: int, extra: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment, its key and exposes files written under ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    exposes = workdir / "exposes.json"
    exposes.write_text(json.dumps([tcp("web", listen, backend)]))
    (workdir / "key").write_text(key)
    return {**os.environ, "AGENT_MODE": "ingress", "TAILNET_CONTROL_URL": headscale.url,
            "TAILNET_AUTH_KEY_FILE": str(workdir / "key"), "TAILNET_HOSTNAME": hostname,
            "TAILNET_CA_BUNDLE": str(headscale.ca_bundle), "TAILNET_EXPOSES_FILE": str(exposes),
            "TAILNET_HEALTH_ADDRESS": f"127.0.0.1:{health}", "TAILNET_UDP_PORT": "off",
            "TAILNET_DRAIN_TIMEOUT": "90", **extra}


class IngressProcess:
    """The real agent process (``python -m tailnet_agent``) in ingress mode with one tcp expose."""

    def __init__(self, process: asyncio.subprocess.Process, health: int, log: Path) -> None:
        self.process, self.health, self.log = process, health, log

    @classmethod
    async def start(cls, workdir: Path, headscale: Headscale, key: str, hostname: str, listen: int,
                    backend: int, extra_env: Mapping[str, str] | None = None) -> IngressProcess:
        health = free_port()
        env = _ingress_environment(workdir, headscale, key, hostname, listen, backend, health, extra_env or {})
        log = workdir / "agent.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(sys.executable, "-m", "tailnet_agent", env=env,
                                                           cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                                           stdin=subprocess.DEVNULL)
        return cls(process, health, log)

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


async def _up(agent: asyncio.subprocess.Process, health: int) -> bool:
    return await readyz(health) == 200 or agent.returncode is not None


async def _at(health: int, status: int) -> bool:
    return await readyz(health) == status


async def _refused_over_tailnet(laptop: TailscaleNode, address: str, port: int) -> bool:
    return not await answers(laptop, address, port)
