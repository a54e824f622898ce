"""The Headscale client against a real Headscale v0.29.2 (fresh database per test) and real tailscaled."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import structlog

from e2e.conftest import TailscaleFactory
from hack.localenv import Headscale, free_port
from tailnet_operator.headscale import (
    AlreadyExists,
    ConnectError,
    HeadscaleClient,
    Node,
    NotFound,
    PolicyRejected,
    TLSVerificationError,
    TransportError,
    Unauthorized,
)

pytestmark = pytest.mark.integration

T = TypeVar("T")

ROUTE = "198.18.77.0/24"
OTHER_ROUTE = "198.18.78.0/24"

POLICY = """// tailnet-operator e2e policy (HuJSON: comments and trailing commas)
{
  "hosts": {"agent-a": "100.64.0.1/32", "agent-b": "100.64.0.2/32"},
  "tagOwners": {
    "tag:agent": [],
    "tag:router": ["tag:agent"],
  },
  "grants": [
    {"src": ["agent-a"], "dst": ["agent-b"], "ip": ["tcp:443"]},
  ],
  "acls": [
    {"action": "accept", "src": ["tag:router"], "proto": "tcp", "dst": ["tag:agent:22"]},
  ],
  "tests": [
    {"src": "agent-a", "accept": ["agent-b:443"], "deny": ["agent-b:22"]},
  ],
}
"""


async def eventually(probe: Callable[[], Awaitable[T | None]], *, timeout: float, what: str) -> T:
    """Poll ``probe`` every 0.2 s until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await probe()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.2)


@pytest.fixture
async def client(headscale: Headscale) -> AsyncIterator[HeadscaleClient]:
    async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hsc:
        yield hsc


async def node_named(client: HeadscaleClient, name: str) -> Node | None:
    return next((n for n in await client.list_nodes() if n.name == name), None)


async def test_server_version_and_health(client: HeadscaleClient, headscale: Headscale) -> None:
    assert await client.version() == "v0.29.2"
    assert (await client.health()).database_connectivity
    # The CA bundle may also be given as PEM text.
    async with HeadscaleClient(headscale.url, headscale.api_key,
                               ca_bundle=headscale.ca_bundle.read_text()) as pem_client:
        assert (await pem_client.health()).database_connectivity


async def test_api_key_lifecycle_and_expired_key_is_unauthorized(client: HeadscaleClient,
                                                                 headscale: Headscale) -> None:
    new = await client.create_api_key(expiration=dt.timedelta(hours=1))
    assert new.key.startswith("hskey-api-")
    listed = {k.prefix: k for k in await client.list_api_keys()}
    assert new.prefix in listed
    mine = listed[new.prefix]
    assert new.info == mine and new.id.isdigit()
    assert mine.expiration is not None and mine.expiration > dt.datetime.now(dt.UTC)
    assert mine.created_at is not None and mine.created_at.tzinfo is not None

    async with HeadscaleClient(headscale.url, new.key, ca_bundle=headscale.ca_bundle) as rotated:
        assert (await rotated.health()).database_connectivity
        await client.expire_api_key(key_id=mine.id)
        with structlog.testing.capture_logs() as logs, pytest.raises(Unauthorized) as info:
            await rotated.list_nodes()
    assert info.value.status == 401 and info.value.message == "Unauthorized"
    secret = new.key[len("hskey-api-") + 13:]
    for text in (str(info.value), repr(info.value), repr(rotated), *map(repr, logs)):
        assert new.key not in text and secret not in text
    expired = {k.prefix: k for k in await client.list_api_keys()}[new.prefix]
    assert expired.expiration is not None and expired.expiration <= dt.datetime.now(dt.UTC)

    # Expire by prefix (the full key is reduced to its public prefix), then delete.
    other = await client.create_api_key(expiration=dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10))
    await client.expire_api_key(prefix=other.key)
    async with HeadscaleClient(headscale.url, other.key, ca_bundle=headscale.ca_bundle) as stale:
        with pytest.raises(Unauthorized):
            await stale.health()
    await client.delete_api_key(new.prefix)
    await client.delete_api_key(other.key)
    remaining = {k.prefix for k in await client.list_api_keys()}
    assert new.prefix not in remaining and other.prefix not in remaining
    assert (await client.health()).database_connectivity, "the bootstrap key still works"


async def test_users_create_list_delete(client: HeadscaleClient) -> None:
    user = await client.create_user("ops", display_name="Operations")
    assert user.id.isdigit() and user.name == "ops" and user.created_at is not None
    assert [u.name for u in await client.list_users(name="ops")] == ["ops"]
    with pytest.raises(AlreadyExists):
        await client.create_user("ops")
    await client.delete_user(user.id)
    assert await client.list_users(name="ops") == []
    with pytest.raises(NotFound):
        await client.delete_user(user.id)


async def test_tagged_reusable_ephemeral_key_joins_a_real_node(client: HeadscaleClient, headscale: Headscale,
                                                              tailscale_nodes: TailscaleFactory) -> None:
    await client.set_policy(POLICY)
    key = await client.create_preauth_key(acl_tags=["tag:agent"], reusable=True, ephemeral=True,
                                          expiration=dt.timedelta(minutes=30))
    assert key.key.startswith("hskey-auth-") and key.key not in repr(key)
    assert key.user is None and key.reusable and key.ephemeral and key.acl_tags == ("tag:agent",)
    assert key.expiration is not None
    assert dt.timedelta(minutes=29) < key.expiration - dt.datetime.now(dt.UTC) <= dt.timedelta(minutes=30)
    listed = {k.id: k for k in await client.list_preauth_keys()}
    assert listed[key.id].key == key.masked_key

    tailscale_nodes("agent-1", headscale, authkey=key.key)
    node = await eventually(lambda: node_named(client, "agent-1"), timeout=30, what="agent-1 in the node list")
    assert node.tags == ("tag:agent",) and node.is_tagged
    assert node.ip_addresses and node.id.isdigit()
    fetched = await client.get_node(node.id)
    assert fetched.id == node.id and fetched.tags == ("tag:agent",) and fetched.user is None
    assert fetched.created_at is not None and fetched.created_at.tzinfo is not None

    await client.expire_preauth_key(key.id)
    expired = {k.id: k for k in await client.list_preauth_keys()}[key.id]
    assert expired.expiration is not None and expired.expiration <= dt.datetime.now(dt.UTC)
    await client.delete_preauth_key(key.id)
    assert key.id not in {k.id for k in await client.list_preauth_keys()}
    assert await client.get_node(node.id), "deleting the key keeps the node"
    with pytest.raises(NotFound):
        await client.get_node("424242")


async def test_advertised_route_is_approved_without_dropping_existing_approvals(
        client: HeadscaleClient, headscale: Headscale, tailscale_nodes: TailscaleFactory) -> None:
    key = await client.create_preauth_key(acl_tags=["tag:router"], expiration=dt.timedelta(minutes=10))
    tailscale_nodes("router-1", headscale, authkey=key.key, advertise_routes=[ROUTE])

    async def advertising() -> Node | None:
        node = await node_named(client, "router-1")
        return node if node is not None and ROUTE in node.available_routes else None

    node = await eventually(advertising, timeout=30, what=f"router-1 advertising {ROUTE}")
    assert ROUTE not in node.approved_routes and ROUTE not in node.subnet_routes

    approved = await client.approve_routes(node.id, [OTHER_ROUTE])  # not advertised: stored anyway
    assert approved.approved_routes == (OTHER_ROUTE,)
    updated = await client.add_approved_routes(node, [ROUTE])
    assert set(updated.approved_routes) == {OTHER_ROUTE, ROUTE}
    again = await client.add_approved_routes(node.id, [ROUTE])
    assert set(again.approved_routes) == {OTHER_ROUTE, ROUTE}

    async def serving() -> Node | None:
        listed = await node_named(client, "router-1")
        return listed if listed is not None and ROUTE in listed.subnet_routes else None

    served = await eventually(serving, timeout=15, what=f"{ROUTE} in subnet routes")
    assert OTHER_ROUTE not in served.subnet_routes, "only advertised and approved routes are served"
    cleared = await client.approve_routes(node.id, [])
    assert cleared.approved_routes == ()


async def test_policy_round_trip_check_and_rejection(client: HeadscaleClient) -> None:
    assert await client.get_policy() == ("", None), "a fresh database has no policy"
    await client.check_policy(POLICY)
    stored = await client.set_policy(POLICY)
    text, updated_at = stored
    assert text == POLICY and updated_at is not None and updated_at.tzinfo is not None
    fetched = await client.get_policy()
    assert fetched == stored

    invalid = POLICY.replace('"tag:router": ["tag:agent"]', '"tag:router": ["tag:missing"]')
    with pytest.raises(PolicyRejected) as check:
        await client.check_policy(invalid)
    assert "tag:missing" in check.value.message and check.value.status == 400
    with pytest.raises(PolicyRejected) as put:
        await client.set_policy(invalid)
    assert "tag:missing" in put.value.message and put.value.message.startswith("setting policy:")
    assert await client.get_policy() == stored, "a refused policy leaves the live one unchanged"

    failing = POLICY.replace('"deny": ["agent-b:22"]', '"deny": ["agent-b:443"]')
    with pytest.raises(PolicyRejected, match=r"test\(s\) failed") as tests_check:
        await client.check_policy(failing)
    assert "agent-b:443" in tests_check.value.message
    with pytest.raises(PolicyRejected, match=r"test\(s\) failed"):
        await client.set_policy(failing)
    assert await client.get_policy() == stored


async def test_connection_refused_raises_transport_error_after_retries(headscale: Headscale) -> None:
    url = f"https://127.0.0.1:{free_port()}"
    async with HeadscaleClient(url, headscale.api_key, ca_bundle=headscale.ca_bundle, backoff=0.05) as hsc:
        with structlog.testing.capture_logs() as logs, pytest.raises(ConnectError) as info:
            await hsc.list_nodes()
    assert isinstance(info.value, TransportError)
    assert "cannot connect" in str(info.value)
    assert sorted(e["attempt"] for e in logs if e["event"] == "headscale request failed") == [1, 2, 3]
    assert all(headscale.api_key not in repr(e) for e in logs)


async def test_untrusted_certificate_is_a_tls_verification_error(headscale: Headscale) -> None:
    async with HeadscaleClient(headscale.url, headscale.api_key) as hsc:  # system roots only
        with structlog.testing.capture_logs() as logs, pytest.raises(TLSVerificationError) as info:
            await hsc.health()
    assert isinstance(info.value, TransportError)
    assert "TLS verification failed" in str(info.value)
    assert len([e for e in logs if e["event"] == "headscale request failed"]) == 1, "never retried"
    assert headscale.api_key not in str(info.value)
