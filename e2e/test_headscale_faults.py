"""Headscale answering badly: the client against a real Headscale v0.29.2, directly and through a
fault-injecting proxy (``e2e/faultproxy.py``) for 500s, timeouts and malformed JSON.

Every test also checks the client's log lines: a normal answer (an empty policy store) is not a
warning, and no line carries the API key or a pre-auth key.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import structlog

from e2e.faultproxy import Fault, FaultProxy
from hack.localenv import Headscale
from tailnet_operator.controllers.sweep import list_orphans
from tailnet_operator.headscale import HeadscaleClient, References, ServerError, installation_tag, sweep_orphans

pytestmark = pytest.mark.integration

MARKER = installation_tag("0c6f1c8e-8a8f-4d0b-9a57-3a2d6c1b4e7f")
"""The installation these tests act for."""

POLICY = '{"tagOwners": {"tag:faults": []}, "grants": [{"src": ["tag:faults"], "dst": ["*"], "ip": ["*"]}]}'
TIMEOUT = 2.0
"""The client's timeout per attempt in these tests; a delayed answer waits longer."""


@pytest.fixture
async def proxy(headscale: Headscale) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(headscale.url, headscale.ca_bundle) as running:
        yield running


def _client(proxy: FaultProxy, headscale: Headscale) -> HeadscaleClient:
    return HeadscaleClient(proxy.url, headscale.api_key, timeout=TIMEOUT, backoff=0.05, owner_tag=MARKER)


def _no_secrets(logs: Sequence[Mapping[str, Any]], *secrets: str) -> None:
    text = json.dumps(logs, default=str)
    for secret in secrets:
        assert secret and secret not in text, "a secret reached the log"


async def test_an_empty_policy_store_is_an_empty_policy_and_no_warning(headscale: Headscale) -> None:
    async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hs:
        with structlog.testing.capture_logs() as logs:
            for _ in range(3):  # as the policy reconciler does every 30 s
                assert await hs.get_policy() == ("", None)
    assert [e for e in logs if e["log_level"] in ("warning", "error")] == []
    assert [e["status"] for e in logs if e["event"] == "headscale answer"] == [500, 500, 500]


async def test_500s_and_malformed_json_on_reads_are_retried_and_the_answer_is_whole(
    proxy: FaultProxy, headscale: Headscale
) -> None:
    async with _client(proxy, headscale) as hs:
        await hs.version()
        proxy.add(Fault("GET", "/api/v1/preauthkey", status=500),
                  Fault("GET", "/api/v1/preauthkey", cut=True))
        with structlog.testing.capture_logs() as logs:
            assert await hs.list_preauth_keys() == []
        assert proxy.injected == ["GET /api/v1/preauthkey status 500", "GET /api/v1/preauthkey cut"]
        assert proxy.seen.count("GET /api/v1/preauthkey") == 3
        assert [e["event"] for e in logs].count("headscale retry") == 2

        # three faults in a row exhaust the three attempts: the error is raised, nothing is made up
        proxy.add(*(Fault("GET", "/api/v1/node", status=500) for _ in range(3)))
        with pytest.raises(ServerError) as raised:
            await hs.list_nodes()
        assert raised.value.transient and raised.value.status == 500


async def test_a_timeout_on_a_policy_write_is_retried_and_the_policy_is_stored_once(
    proxy: FaultProxy, headscale: Headscale
) -> None:
    async with _client(proxy, headscale) as hs:
        proxy.add(Fault("PUT", "/api/v1/policy", delay=TIMEOUT + 1))
        stored = await hs.set_policy(POLICY)
        assert json.loads(stored.text) == json.loads(POLICY)
        assert proxy.seen.count("PUT /api/v1/policy") == 2
        assert json.loads((await hs.get_policy()).text) == json.loads(POLICY)


async def test_a_create_whose_answer_is_cut_is_not_repeated_and_its_key_is_swept(
    proxy: FaultProxy, headscale: Headscale
) -> None:
    async with _client(proxy, headscale) as hs:
        await hs.version()
        await hs.set_policy(POLICY)
        # a gateway 502: Headscale never saw the request, so the create is retried and one key made
        proxy.add(Fault("POST", "/api/v1/preauthkey", status=502, body=b"Bad Gateway"))
        with structlog.testing.capture_logs() as logs:
            made = await hs.create_preauth_key(acl_tags=["tag:faults", MARKER], reusable=True, ephemeral=True,
                                               expiration=dt.timedelta(hours=1))
        assert proxy.seen.count("POST /api/v1/preauthkey") == 2
        assert [k.id for k in await hs.list_preauth_keys()] == [made.id]

        # the answer cut in half after Headscale made the key: not repeated (no second key), the
        # error names no secret, and the key, unrecorded anywhere, is an orphan the sweep expires
        proxy.add(Fault("POST", "/api/v1/preauthkey", cut=True))
        with structlog.testing.capture_logs() as more, pytest.raises(ServerError) as raised:
            await hs.create_preauth_key(acl_tags=["tag:faults", MARKER], reusable=True, ephemeral=True,
                                        expiration=dt.timedelta(hours=1))
        assert "hskey-auth-" not in str(raised.value)
        keys = await hs.list_preauth_keys()
        assert len(keys) == 2
        [lost] = [k for k in keys if k.id != made.id]
        orphans = await list_orphans(hs, References(key_ids=frozenset({made.id}), tags=frozenset({"tag:faults"})))
        assert [k.id for k in orphans.keys] == [lost.id]
        await sweep_orphans(hs, orphans)
        assert not await list_orphans(hs, References(key_ids=frozenset({made.id})))
    _no_secrets(logs + more, headscale.api_key, made.key)
