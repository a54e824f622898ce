"""The capability-version check of the control client against each Headscale minor."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tailnet_agent.control import CAPABILITY_VERSION, ControlClient, UnsupportedServer, check_server
from tailnet_agent.control.compat import MIN_CAPABILITY_VERSION, refusal

from .test_client import FakeControl, make_client


@pytest.mark.parametrize("reported", ["", "v0.27.1", "v0.28.0", "v0.29.2", "v0.30.0", "dev"])
def test_every_supported_headscale_accepts_this_agent(reported: str) -> None:
    assert check_server(reported, CAPABILITY_VERSION) == ""


def test_a_headscale_older_than_026_is_too_old() -> None:
    with pytest.raises(UnsupportedServer, match=r"v0.25.1 is too old: this agent supports Headscale 0.26 to 0.30"):
        check_server("v0.25.1", CAPABILITY_VERSION)


def test_a_headscale_whose_minimum_is_above_the_agent_is_too_new() -> None:
    with pytest.raises(UnsupportedServer) as info:
        check_server("v0.29.2", 106)
    message = str(info.value)
    assert "too new for this agent" in message
    assert "capability version 113 (tailscale v1.80)" in message and "speaks 106 (v1.74)" in message
    assert "upgrade the agent" in message
    assert check_server("v0.28.0", 106) == ""  # 0.28 still takes v1.74


def test_a_headscale_newer_than_the_table_is_noted_not_refused() -> None:
    assert "newer than the versions this agent was tested with" in check_server("v0.31.0", CAPABILITY_VERSION)
    assert max(MIN_CAPABILITY_VERSION.values()) <= CAPABILITY_VERSION


def test_headscales_refusal_becomes_an_unsupported_server_error() -> None:
    error = refusal(400, b"unsupported client version: v1.60 (87)\n", 87, path="/machine/register")
    assert error is not None and "upgrade the agent" in str(error)
    assert refusal(400, b"bad request", 87, path="/machine/register") is None
    assert refusal(500, b"unsupported client version", 87, path="/machine/map") is None


async def test_the_client_refuses_before_connecting_to_a_server_that_needs_a_newer_agent() -> None:
    server = FakeControl()
    base = make_client(server, [])

    async def version() -> str:
        return "v0.29.2"

    options = dataclasses.replace(base.options, capability_version=106)
    client = ControlClient(options, _connect=base._connect, _server_version=version)
    with pytest.raises(UnsupportedServer, match="too new for this agent"):
        await asyncio.wait_for(client.run(), timeout=5)
    assert server.connects == 0
    assert client.server_version == "v0.29.2"


async def test_a_register_refused_for_the_capability_version_is_terminal_and_says_why() -> None:
    server = FakeControl(register_answers=[{"_status": 400, "error": "unsupported client version: v1.74 (106)"}])
    client = make_client(server, [])
    with pytest.raises(UnsupportedServer, match="refused this agent's capability version"):
        await asyncio.wait_for(client.run(), timeout=5)
