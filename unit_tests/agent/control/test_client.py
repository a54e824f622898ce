"""The client's register/poll/reconnect policy against a scripted fake control server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from tailnet_agent.contract.backoff import Backoff
from tailnet_agent.control.client import KEY_POLL, ControlClient, ControlOptions, ControlTransport, StreamingBody
from tailnet_agent.control.controlconn import Response
from tailnet_agent.control.errors import ConnectionLost, KeyRefused, RegistrationError
from tailnet_agent.control.keys import NodeKeys
from tailnet_agent.control.mapstream import encode_frame

SECRET = "hskey-auth-SECRETSECRET"
SELF = {"ID": 1, "Key": "nodekey:" + "00" * 32, "Addresses": ["100.64.0.1/32"]}


class Stop(BaseException):
    """Ends ``run`` from the fake sleep (not a ControlError, so the client does not catch it)."""


@dataclass
class MapScript:
    status: int = 200
    frames: list[dict[str, Any]] = field(default_factory=list)
    hang: bool = False
    """Keep the stream open without data after the frames (for the watchdog)."""


@dataclass
class FakeControl:
    register_answers: list[dict[str, Any]] = field(default_factory=list)
    maps: list[MapScript] = field(default_factory=list)
    register_bodies: list[dict[str, Any]] = field(default_factory=list)
    map_bodies: list[dict[str, Any]] = field(default_factory=list)
    connects: int = 0
    fail_connects: int = 0
    machine_keys: list[str] = field(default_factory=list)
    """The machine public key of each connection."""


class FakeStream:
    def __init__(self, script: MapScript) -> None:
        self.status = script.status
        self._script = script

    async def chunks(self) -> AsyncIterator[bytes]:
        for frame in self._script.frames:
            wire = encode_frame(frame)
            yield wire[:3]  # split frames across chunks
            yield wire[3:]
        if self._script.hang:
            await asyncio.Event().wait()

    async def read(self) -> bytes:
        return b"not found"


class FakeConn:
    def __init__(self, server: FakeControl) -> None:
        self.server = server
        self.closed = asyncio.Event()

    async def run(self) -> None:
        await self.closed.wait()

    async def request(self, method: str, path: str, json_body: Any = None) -> Response:
        assert (method, path) == ("POST", "/machine/register")
        self.server.register_bodies.append(json_body)
        answer = self.server.register_answers.pop(0) if self.server.register_answers else {
            "MachineAuthorized": True}
        status = int(answer.pop("_status", 200))
        return Response(status=status, headers={}, body=json.dumps(answer).encode())

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, json_body: Any = None) -> AsyncIterator[StreamingBody]:
        assert (method, path) == ("POST", "/machine/map")
        self.server.map_bodies.append(json_body)
        script = self.server.maps.pop(0) if self.server.maps else MapScript(hang=True)
        yield FakeStream(script)

    async def aclose(self) -> None:
        self.closed.set()


def make_client(server: FakeControl, sleeps: list[float], *, stop_after: int = 1,
                watchdog: float = 120.0) -> ControlClient:
    async def connect(keys: NodeKeys) -> ControlTransport:
        server.connects += 1
        server.machine_keys.append(str(keys.machine.public))
        if server.fail_connects:
            server.fail_connects -= 1
            raise ConnectionLost("refused")
        return FakeConn(server)

    async def sleep(delay: float) -> None:
        sleeps.append(delay)
        if len(sleeps) >= stop_after:
            raise Stop

    options = ControlOptions(url="https://control.test", auth_key=SECRET, hostname="agent-1",
                             map_watchdog=watchdog, backoff=Backoff(initial=1.0, maximum=8.0, _random=lambda: 1.0))
    return ControlClient(options, _connect=connect, _sleep=sleep)


async def run_until_stop(client: ControlClient) -> None:
    with pytest.raises(Stop):
        await asyncio.wait_for(client.run(), timeout=5)


async def test_register_then_poll_builds_the_netmap_without_logging_the_key() -> None:
    server = FakeControl(maps=[MapScript(frames=[{"KeepAlive": True}, {"Node": SELF, "Peers": [
        {"ID": 2, "Key": "nodekey:" + "22" * 32, "Addresses": ["100.64.0.2/32"]}]}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps)
    with capture_logs() as logs:
        await run_until_stop(client)  # the stream ends after the frames: connection lost, one sleep
    reg = server.register_bodies[0]
    assert reg["NodeKey"] == str(client.keys.node.public) and reg["Auth"] == {"AuthKey": SECRET}
    assert reg["Hostinfo"]["Hostname"] == "agent-1" and "RequestTags" not in reg["Hostinfo"]
    assert reg["Ephemeral"] is True and reg["Version"] == 138 and "OldNodeKey" not in reg and "NLKey" not in reg
    poll = server.map_bodies[0]
    assert poll["Stream"] is True and poll["KeepAlive"] is True and poll["OmitPeers"] is False
    assert poll["Compress"] == "" and poll["DiscoKey"] == str(client.keys.disco.public)
    assert client.netmap is not None and set(client.netmap.peers) == {2}
    assert client.map_messages == 2 and client.map_sessions == 1
    assert SECRET not in repr(logs) and client.keys.machine.raw.hex() not in repr(logs)
    assert SECRET not in repr(client.options)


async def test_connection_loss_reconnects_with_backoff_without_re_registering() -> None:
    server = FakeControl(fail_connects=2, maps=[MapScript(frames=[{"Node": SELF}]),
                                                MapScript(frames=[{"Node": SELF}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps, stop_after=4)
    await run_until_stop(client)
    # two failed connects back off 1s, 2s; each poll that delivered a message resets the backoff.
    assert sleeps == [1.0, 2.0, 1.0, 1.0]
    assert len(server.register_bodies) == 1 and client.map_sessions == 2


async def test_map_404_re_registers_with_the_same_node_key() -> None:
    server = FakeControl(maps=[MapScript(status=404), MapScript(frames=[{"Node": SELF}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps, stop_after=2)
    await run_until_stop(client)
    assert len(server.register_bodies) == 2
    assert server.register_bodies[0]["NodeKey"] == server.register_bodies[1]["NodeKey"]
    assert client.map_sessions == 1 and client.netmap is not None


async def test_node_key_expired_rotates_the_key() -> None:
    server = FakeControl(register_answers=[{"NodeKeyExpired": True}, {"MachineAuthorized": True}],
                         maps=[MapScript(frames=[{"Node": SELF}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps)
    old = str(client.keys.node.public)
    await run_until_stop(client)
    first, second = server.register_bodies
    assert first["NodeKey"] == old and "OldNodeKey" not in first
    assert second["OldNodeKey"] == old and second["NodeKey"] != old
    assert server.map_bodies[0]["NodeKey"] == second["NodeKey"]


async def test_still_expired_after_rotation_joins_as_a_new_node() -> None:
    server = FakeControl(register_answers=[{"NodeKeyExpired": True}, {"NodeKeyExpired": True},
                                           {"MachineAuthorized": True}],
                         maps=[MapScript(frames=[{"Node": SELF}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps, stop_after=2)
    first_disco = str(client.keys.disco.public)
    with capture_logs() as logs:
        await run_until_stop(client)
    first, rotated, fresh = server.register_bodies
    assert rotated["OldNodeKey"] == first["NodeKey"]
    assert "OldNodeKey" not in fresh and fresh["NodeKey"] not in (first["NodeKey"], rotated["NodeKey"])
    assert len(server.machine_keys) == 2 and server.machine_keys[0] != server.machine_keys[1], \
        "a new node needs a new machine key, so a new connection"
    assert str(client.keys.disco.public) != first_disco
    assert client.netmap is not None
    assert any(e["event"] == "joining as a new node" for e in logs)


async def test_self_node_expired_rotates_and_re_registers() -> None:
    server = FakeControl(maps=[MapScript(frames=[{"Node": {**SELF, "Expired": True}}]),
                               MapScript(frames=[{"Node": SELF}])])
    sleeps: list[float] = []
    client = make_client(server, sleeps, stop_after=2)
    await run_until_stop(client)
    assert len(server.register_bodies) == 2
    assert server.register_bodies[1]["OldNodeKey"] == server.register_bodies[0]["NodeKey"]


@pytest.mark.parametrize("answer", [{"Error": "invalid authkey"}, {"_status": 401},
                                    {"AuthURL": "https://login", "MachineAuthorized": False}])
async def test_refused_registration_is_terminal(answer: dict[str, Any]) -> None:
    server = FakeControl(register_answers=[answer])
    client = make_client(server, [])
    with pytest.raises(RegistrationError):
        await asyncio.wait_for(client.run(), timeout=5)
    assert not client.registered


async def test_watchdog_abandons_a_silent_poll() -> None:
    server = FakeControl(maps=[MapScript(frames=[{"Node": SELF}], hang=True)])
    sleeps: list[float] = []
    client = make_client(server, sleeps, watchdog=0.05)
    with capture_logs() as logs:
        await run_until_stop(client)
    assert any("no map message" in str(entry.get("error")) for entry in logs)


def test_backoff_grows_caps_and_resets() -> None:
    backoff = Backoff(initial=1.0, maximum=5.0, _random=lambda: 0.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 2.5, 2.5]
    backoff.reset()
    assert backoff.next() == 0.5


async def test_logout_is_a_register_with_an_expiry_in_the_past_and_no_key_then_no_reconnect() -> None:
    """Without a connection in use, logout opens one, sends tailscaled's logout (no ``Auth``, an
    ``Expiry`` in the past) and closes it; ``run`` afterwards neither connects nor registers."""
    server = FakeControl()
    client = make_client(server, [])
    assert await client.logout() is True
    assert server.connects == 1
    body = server.register_bodies[0]
    assert "Auth" not in body and body["Expiry"] == "1970-01-01T00:02:03Z"
    assert body["NodeKey"] == str(client.keys.node.public) and body["Ephemeral"] is True
    run = asyncio.create_task(client.run())
    done, _ = await asyncio.wait([run], timeout=0.2)
    assert not done and server.connects == 1 and len(server.register_bodies) == 1
    run.cancel()


async def test_a_refused_key_waits_for_a_new_one_in_its_file_and_gives_up_after_key_wait(tmp_path: Path) -> None:
    key_file = tmp_path / "authkey"
    key_file.write_text(SECRET + "\n")
    server = FakeControl(register_answers=[{"Error": "authkey expired"}],
                         maps=[MapScript(frames=[{"Node": SELF}], hang=True)])
    sleeps: list[float] = []

    async def connect(keys: NodeKeys) -> ControlTransport:
        server.connects += 1
        return FakeConn(server)

    async def sleep(delay: float) -> None:  # kubelet writes the new key during the second wait
        sleeps.append(delay)
        if len(sleeps) == 2:
            key_file.write_text("hskey-auth-NEWNEWNEW\n")

    options = ControlOptions(url="https://control.test", auth_key=SECRET, hostname="agent-1", auth_key_file=key_file,
                             key_wait=20.0, backoff=Backoff(initial=1.0, maximum=8.0, _random=lambda: 1.0))
    registered = asyncio.Event()
    client = ControlClient(options, _connect=connect, _sleep=sleep, on_netmap=lambda _: registered.set())
    run = asyncio.create_task(client.run())
    try:
        await asyncio.wait([run, asyncio.ensure_future(registered.wait())], timeout=5,
                           return_when=asyncio.FIRST_COMPLETED)
        assert registered.is_set(), run
        assert [b["Auth"]["AuthKey"] for b in server.register_bodies] == [SECRET, "hskey-auth-NEWNEWNEW"]
        assert sleeps == [KEY_POLL, KEY_POLL] and client.key_refused is None
    finally:
        run.cancel()
    key_file.write_text(SECRET)  # a file that never changes: the refusal is final after key_wait
    unchanged = FakeControl(register_answers=[{"_status": 401}])
    waits: list[float] = []

    async def no_change(delay: float) -> None:
        waits.append(delay)

    async def connect_unchanged(keys: NodeKeys) -> ControlTransport:
        return FakeConn(unchanged)

    client = ControlClient(options, _connect=connect_unchanged, _sleep=no_change)
    with pytest.raises(KeyRefused, match="HTTP 401"):
        await asyncio.wait_for(client.run(), 5)
    assert waits == [KEY_POLL] * 4  # key_wait 20 s / 5 s



async def test_advertised_routes_go_in_the_hostinfo_and_a_withdrawal_goes_with_the_next_poll() -> None:
    server = FakeControl(maps=[MapScript(frames=[{"Node": SELF}])])
    client = make_client(server, [])
    client.routes = ("198.18.5.10/32",)
    await run_until_stop(client)
    assert server.register_bodies[0]["Hostinfo"]["RoutableIPs"] == ["198.18.5.10/32"]
    assert server.map_bodies[0]["Hostinfo"]["RoutableIPs"] == ["198.18.5.10/32"]
    assert await client.set_routes(()) is False, "not connected: nothing sent now"
    assert "RoutableIPs" not in client.map_request()["Hostinfo"]
