"""The interop slice: what must hold for every Headscale and tailscale pair ``make interop`` runs.

The same fixtures as the rest of the suite; ``$TAILNET_HEADSCALE_VERSION`` and
``$TAILNET_TAILSCALE_VERSION`` choose the binaries (``hack/versions.py`` ranges). With neither set
this runs against the pins. ``make interop`` also selects, from the other modules, the Tailnet
key mint/rotate test and the policy-apply-and-site-route test (``hack/interop.py`` lists them).

Expectations that depend on the server's version come from ``headscale.minor``: grants and the
policy check exist from 0.29, tag-only pre-auth keys and id-based key calls from 0.28.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
from pathlib import Path

import pytest

from e2e.skips import skip_by_design
from hack import binaries
from hack.localenv import ControlPlane, Headscale
from tailnet_agent.control import ControlClient, ControlOptions, UnsupportedServer
from tailnet_agent.control.compat import MIN_CAPABILITY_VERSION
from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.headscale import HeadscaleClient, Unauthorized
from tailnet_operator.runtime.client import Client

from .conftest import TailscaleFactory
from .operator import create_bootstrap_secret, has_condition, running_operator, tailnet_object
from .polling import eventually
from .test_agent_egress import (
    TAG,
    connect_and_close,
    direct_peers,
    local_server,
    read_all,
    running_agent,
    target,
    wait_peer_sees,
)
from .test_policy_reconciler import OPEN_BASE, base_policy

pytestmark = pytest.mark.integration

SIZE = 4 << 20
"""Bytes each way through the egress path: enough for many DERP frames / UDP packets, quick."""


@pytest.fixture
def namespace(operator_namespace: str) -> str:
    return operator_namespace


def test_the_binaries_are_the_selected_versions(headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    """The run really uses the versions the matrix cell names (a wrong cache would pass silently)."""
    tailscale = binaries.selected(binaries.TAILSCALE)
    assert headscale.version == os.environ.get("TAILNET_HEADSCALE_VERSION", binaries.HEADSCALE.version)
    assert tailscale.version == os.environ.get("TAILNET_TAILSCALE_VERSION", binaries.TAILSCALE.version)
    assert headscale.process.pid is not None
    running = Path(f"/proc/{headscale.process.pid}/exe").resolve()
    assert running.parent.name == f"headscale-{headscale.version}", running
    out = headscale.cli("version")
    # 0.26 reports the version only when the release build sets it with -ldflags ("dev" here).
    assert headscale.version in out or (headscale.minor < (0, 27) and out.strip() == "dev"), out
    node = tailscale_nodes("ts-version", headscale, authkey=headscale.create_preauth_key(tags=[TAG]))
    # Built outside tailscale's release tooling it says "<version>-ERR-BuildInfo".
    assert node.cli("version").splitlines()[0].split("-")[0] == tailscale.version


async def test_the_client_adapts_key_calls_to_the_server(headscale: Headscale) -> None:
    async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hs:
        features = await hs.features()
        assert features.minor == headscale.minor
        assert (await hs.health()).database_connectivity

        # A tag-only pre-auth key: listed, then expired by id (per user and by value before 0.28).
        key = await hs.create_preauth_key(acl_tags=["tag:interop"], reusable=True, expiration=dt.timedelta(hours=1))
        assert key.acl_tags == ("tag:interop",)
        assert key.id in {k.id for k in await hs.list_preauth_keys()}
        await hs.expire_preauth_key(key.id)
        listed = next(k for k in await hs.list_preauth_keys() if k.id == key.id)
        assert listed.expiration is not None and listed.expiration <= dt.datetime.now(dt.UTC)

        # An API key minted, used, then expired by id (by its prefix before 0.28).
        new = await hs.create_api_key(expiration=dt.timedelta(hours=1))
        assert new.id, "the new key is found in the list"
        async with HeadscaleClient(headscale.url, new.key, ca_bundle=headscale.ca_bundle) as minted:
            await minted.list_api_keys()
            await hs.expire_api_key(key_id=new.id)
            with pytest.raises(Unauthorized):
                await minted.list_api_keys()

        # The policy check exists from 0.29; before, the client says it did not check.
        assert await hs.check_policy('{"acls": [{"action": "accept", "src": ["*"], "dst": ["*:*"]}]}') is (
            headscale.minor >= (0, 29))


async def test_grants_apply_or_the_condition_says_the_server_lacks_them(
        admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str) -> None:
    """A base with grants: written on 0.29+; before, not written, with a condition that says why."""
    tailnet = f"{namespace}-tn"
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    policy = await base_policy(admin, namespace, OPEN_BASE)
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(tailnet, headscale, namespace, policy={**policy, "mode": "Apply"}))
        if headscale.minor >= (0, 29):
            await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "True", "Applied"), timeout=60,
                             what="the grants policy applied")
            assert "grants" in headscale.api("GET", "/api/v1/policy")["policy"]
        else:
            cond = await eventually(has_condition(admin, TAILNET, tailnet, "PolicyApplied", "False",
                                                  "GrantsUnsupported"), timeout=60, what="GrantsUnsupported")
            assert "upgrade Headscale to 0.29" in cond["message"]


async def test_an_agent_below_the_servers_capability_version_gets_a_clear_error(headscale: Headscale) -> None:
    minimum = MIN_CAPABILITY_VERSION[headscale.minor]
    options = ControlOptions(url=headscale.url, auth_key="unused", hostname="too-old", ca_bundle=headscale.ca_bundle,
                             capability_version=minimum - 1)
    with pytest.raises(UnsupportedServer, match="too new for this agent") as info:
        await asyncio.wait_for(ControlClient(options).run(), timeout=30)
    assert f"capability version {minimum}" in str(info.value)


@pytest.mark.parametrize("path", ["derp", "direct"])
async def test_egress_from_the_agent_to_a_tailscaled_peer(
        headscale: Headscale, tailscale_nodes: TailscaleFactory, path: str) -> None:
    download, upload = os.urandom(SIZE), os.urandom(SIZE)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Sizes are known, so neither side half-closes (see the half-close test for that).
        receiving = asyncio.create_task(reader.readexactly(SIZE))
        writer.write(download)
        await writer.drain()
        writer.write(hashlib.sha256(await receiving).digest())
        await writer.drain()
        await reader.read()  # the agent's side closes first
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes(f"ts-interop-{path}", headscale, authkey=key)
    options = {"udp_port": 0} if path == "direct" else {}
    async with local_server(handler) as port, \
            running_agent(headscale, f"agent-interop-{path}", key, [target("peer", peer.ipv4(), port)],
                          **options) as agent:
        await wait_peer_sees(peer, f"agent-interop-{path}")
        if path == "direct":
            await connect_and_close(agent.listen_port("peer", port))
            await eventually(lambda: direct_peers(agent) == [f"ts-interop-{path}"], timeout=30,
                             what="a direct UDP path to the peer")
        before = dict(agent.node.counters)
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("peer", port))
        writer.write(upload)
        await writer.drain()
        received = await asyncio.wait_for(reader.readexactly(SIZE + 32), 60)
        writer.close()
        assert len(received) == SIZE + 32, f"received {len(received)} bytes, expected {SIZE} + a 32-byte digest"
        assert received[:SIZE] == download, f"the download differs from byte {_first_difference(received, download)}"
        assert received[SIZE:] == hashlib.sha256(upload).digest(), "the peer side received a different upload"
        udp_out = agent.node.counters.get("udp_bytes_out", 0) - before.get("udp_bytes_out", 0)
        udp_in = agent.node.counters.get("udp_bytes_in", 0) - before.get("udp_bytes_in", 0)
        if path == "direct":
            assert udp_out > SIZE and udp_in > SIZE, "both directions went over the direct path"
        else:
            assert udp_out == udp_in == 0, "everything went through DERP"


HALF_CLOSE_FIXED = (1, 86)
"""tailscaled proxies a half-closed TCP connection correctly from 1.86 (tailscale commit 04d24cd,
"wgengine/netstack: correctly proxy half-closed TCP connections"); before, a FIN from the tailnet
side closes both directions towards the local server."""


async def test_a_half_close_through_a_tailscaled_peer_keeps_the_response(
        headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    version = binaries.selected(binaries.TAILSCALE).version
    if tuple(int(p) for p in version.split(".")[:2]) < HALF_CLOSE_FIXED:
        skip_by_design(f"tailscaled {version} closes both directions when the client half-closes (fixed in 1.86): "
                    "an egress client that shuts down its write side early loses the reply from such a peer")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_all(reader)  # until the client's FIN
        writer.write(hashlib.sha256(request).digest() * 4096)  # 128 KiB after the FIN
        await writer.drain()
        writer.close()

    key = headscale.create_preauth_key(tags=[TAG], reusable=True, ephemeral=True)
    peer = tailscale_nodes("ts-interop-half", headscale, authkey=key)
    request = os.urandom(256 << 10)
    async with local_server(handler) as port, \
            running_agent(headscale, "agent-interop-half", key, [target("peer", peer.ipv4(), port)]) as agent:
        await wait_peer_sees(peer, "agent-interop-half")
        reader, writer = await asyncio.open_connection("127.0.0.1", agent.listen_port("peer", port))
        writer.write(request)
        await writer.drain()
        writer.write_eof()
        received = await asyncio.wait_for(read_all(reader), 60)
        writer.close()
        assert received == hashlib.sha256(request).digest() * 4096, f"{len(received)} bytes of {32 * 4096}"


def _first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
