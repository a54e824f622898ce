"""The Tailnet reconciler against a real kube-apiserver and a real Headscale (v0.29.2 unless
``$TAILNET_HEADSCALE_VERSION`` names another)."""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime, timedelta

import pytest

from e2e.faultproxy import Fault, FaultProxy
from hack.localenv import ControlPlane, Headscale
from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.controllers.tailnet import working_key_secret_name
from tailnet_operator.headscale import HeadscaleClient, Unauthorized, raw_api_key_prefix
from tailnet_operator.runtime.client import Client
from tailnet_operator.runtime.kinds import EVENT, SECRET

from .operator import (
    ShiftedClock,
    create_bootstrap_secret,
    get_or_none,
    gone,
    has_condition,
    running_operator,
    tailnet_object,
    unique,
)
from .polling import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def namespace(operator_namespace: str) -> str:
    return operator_namespace






async def working_key(admin: Client, namespace: str, tailnet: str) -> str | None:
    if (secret := await get_or_none(admin, SECRET, working_key_secret_name(tailnet), namespace)) is None:
        return None
    return base64.b64decode(secret["data"]["apiKey"]).decode()


async def key_works(headscale: Headscale, key: str) -> bool:
    async with HeadscaleClient(headscale.url, key, ca_bundle=headscale.ca_bundle) as hs:
        try:
            await hs.list_api_keys()
        except Unauthorized:
            return False
    return True


async def event_reasons(admin: Client, name: str) -> set[str]:
    events = await admin.list(EVENT, "default")
    return {e.get("reason", "") for e in events.items if (e.get("regarding") or {}).get("name") == name}


async def test_working_key_is_minted_used_and_rotated_old_key_expired_only_after(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    name = unique("tn")
    clock = ShiftedClock()
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace, clock=clock) as op:
        await admin.create(TAILNET, tailnet_object(name, headscale, namespace, lifetime="2h"))
        ready = await eventually(has_condition(admin, TAILNET, name, "Ready", "True", "Connected"), what="Ready")
        expected = headscale.version if headscale.minor >= (0, 27) else "0.26"  # 0.26 has no /version
        assert expected in ready["message"]
        first = await working_key(admin, namespace, name)
        assert first is not None and first != headscale.api_key
        assert await key_works(headscale, first)
        status = (await admin.get(TAILNET, name))["status"]
        first_id = status["apiKey"]["id"]
        assert status["serverVersion"].lstrip("v").startswith(expected)
        assert status["apiKey"]["prefix"] and status["apiKey"]["nextRotationAt"]
        assert "WorkingKeyMinted" in await event_reasons(admin, name)

        clock.offset = timedelta(minutes=61)  # past half of the 2h lifetime
        op.poke(name)

        async def rotated() -> bool:
            current = (await admin.get(TAILNET, name))["status"]["apiKey"]["id"]
            return bool(current != first_id)

        await eventually(rotated, what="a rotated key in status")
        second = await working_key(admin, namespace, name)
        assert second is not None and second != first
        assert await key_works(headscale, second)
        await eventually(lambda: _not(key_works(headscale, first)), what="the old key to be expired")
        assert "WorkingKeyRotated" in await event_reasons(admin, name)
        assert await key_works(headscale, headscale.api_key), "the bootstrap key is never touched"


async def _not(awaitable: object) -> bool:
    return not await awaitable  # type: ignore[misc]


async def test_killed_between_new_key_stored_and_old_key_expired_recovers_with_access(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    name = unique("tn")
    clock = ShiftedClock()
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace, clock=clock):
        await admin.create(TAILNET, tailnet_object(name, headscale, namespace, lifetime="2h"))
        await eventually(has_condition(admin, TAILNET, name, "Ready", "True"), what="Ready")
    first = await working_key(admin, namespace, name)
    assert first is not None

    class Killed(BaseException):
        """Stands for the process dying: nothing after this point of the rotation runs."""

    killed = asyncio.Event()

    async def die() -> None:
        killed.set()
        raise Killed

    clock.offset = timedelta(minutes=61)
    async with running_operator(control_plane.kubeconfig, namespace, clock=clock, after_store=die) as op:
        op.poke(name)
        await eventually(killed.is_set, what="the rotation to reach the crash point")
    new = await working_key(admin, namespace, name)
    assert new is not None and new != first
    secret = await admin.get(SECRET, working_key_secret_name(name), namespace)
    assert secret["metadata"]["annotations"].get("tailnet.dev/previous-key-id"), "crash left the old key pending"
    assert await key_works(headscale, first), "the old key must not be expired before the crash point"
    assert await key_works(headscale, new)

    async with running_operator(control_plane.kubeconfig, namespace, clock=clock):
        await eventually(lambda: _not(key_works(headscale, first)), what="the restarted operator to expire the old key")
        await eventually(has_condition(admin, TAILNET, name, "Ready", "True"), what="Ready after restart")
        assert await working_key(admin, namespace, name) == new
        assert await key_works(headscale, new)


async def test_each_failure_has_its_own_reason_and_recovers_without_a_restart(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    missing, rejected, down, tls = (unique(p) for p in ("missing", "rejected", "down", "tls"))
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(missing, headscale, namespace, secret="absent"))
        cond = await eventually(has_condition(admin, TAILNET, missing, "Ready", "False", "BootstrapSecretMissing"),
                                what="BootstrapSecretMissing")
        assert f"{namespace}/absent" in cond["message"]

        await create_bootstrap_secret(admin, namespace, "bad", "hskey-api-notarealkey0-" + "x" * 64)
        await admin.create(TAILNET, tailnet_object(rejected, headscale, namespace, secret="bad"))
        await eventually(has_condition(admin, TAILNET, rejected, "Ready", "False", "BootstrapKeyRejected"),
                         what="BootstrapKeyRejected")

        await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
        await admin.create(TAILNET, tailnet_object(tls, headscale, namespace, ca=False))
        cond = await eventually(has_condition(admin, TAILNET, tls, "Ready", "False", "TLSError"), what="TLSError")
        assert "caBundle" in cond["message"]

        headscale.stop()
        await admin.create(TAILNET, tailnet_object(down, headscale, namespace))
        await eventually(has_condition(admin, TAILNET, down, "Ready", "False", "Unreachable"), what="Unreachable")

        # Fix each one; no restart of the operator.
        headscale.restart()
        await create_bootstrap_secret(admin, namespace, "absent", headscale.api_key)
        await create_bootstrap_secret(admin, namespace, "bad", headscale.api_key)
        for name in (missing, rejected, down):
            await eventually(has_condition(admin, TAILNET, name, "Ready", "True", "Connected"), timeout=45,
                             what=f"{name} to recover")


async def test_a_working_key_deleted_by_hand_is_replaced_from_the_bootstrap_key(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    name = unique("tn")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace) as op:
        await admin.create(TAILNET, tailnet_object(name, headscale, namespace))
        await eventually(has_condition(admin, TAILNET, name, "Ready", "True"), what="Ready")
        first = await working_key(admin, namespace, name)
        assert first is not None
        # The 12-character prefix is URL-safe base64 and may itself contain "-".
        headscale.cli("apikeys", "expire", "--prefix", raw_api_key_prefix(first))
        await eventually(lambda: _not(key_works(headscale, first)), what="the key expired by hand to be refused")
        op.poke(name)

        async def replaced() -> bool:
            key = await working_key(admin, namespace, name)
            return key is not None and key != first and await key_works(headscale, key)

        await eventually(replaced, what="a new working key")

        async def reported() -> bool:
            return "WorkingKeyRejected" in await event_reasons(admin, name)

        await eventually(reported, what="a WorkingKeyRejected Event")


async def test_deleting_a_tailnet_expires_its_working_key(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str
) -> None:
    name = unique("tn")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    async with running_operator(control_plane.kubeconfig, namespace):
        await admin.create(TAILNET, tailnet_object(name, headscale, namespace))
        await eventually(has_condition(admin, TAILNET, name, "Ready", "True"), what="Ready")
        key = await working_key(admin, namespace, name)
        assert key is not None
        await admin.delete(TAILNET, name)
        await eventually(lambda: gone(admin, TAILNET, name), what="the Tailnet to be deleted after its finalizer ran")
        assert not await key_works(headscale, key)


async def _live_api_keys(headscale: Headscale) -> dict[str, str]:
    """id -> bare prefix of every API key Headscale would still accept."""
    async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle) as hs:
        keys = await hs.list_api_keys()
    now = datetime.now(UTC)
    return {k.id: raw_api_key_prefix(k.prefix) for k in keys if k.expiration is None or k.expiration > now}


@pytest.mark.parametrize("fault", [
    Fault("POST", "/api/v1/apikey", lost=True),
    Fault("GET", "/api/v1/apikey", status=503, body=b'{"code": 14, "message": "unavailable"}'),
], ids=["answer to the create lost", "lookup after the create failed"])
async def test_a_mint_whose_outcome_was_not_seen_leaves_no_usable_key_behind(
    admin: Client, control_plane: ControlPlane, headscale: Headscale, namespace: str, fault: Fault
) -> None:
    """Headscale created a key but the operator never learnt which (its answer lost, or the list
    that names the new key failed): the retry mints another, and the first must not stay usable."""
    name = unique("tn")
    await create_bootstrap_secret(admin, namespace, "bootstrap", headscale.api_key)
    before = await _live_api_keys(headscale)
    async with FaultProxy(headscale.url, headscale.ca_bundle) as proxy:
        proxy.add(*[fault] * 3 if fault.status else [fault])  # a 503 on a read is retried by the client
        obj = tailnet_object(name, headscale, namespace, ca=False, allowInsecureHTTP=True)
        obj["spec"]["loginURL"] = proxy.url
        async with running_operator(control_plane.kubeconfig, namespace):
            await admin.create(TAILNET, obj)
            await eventually(has_condition(admin, TAILNET, name, "Ready", "True"), timeout=45, what="Ready")
            assert proxy.injected, "the fault was never used"
            working = await working_key(admin, namespace, name)
            assert working is not None

            async def only_the_working_key_is_new() -> dict[str, str] | None:
                new = {i: p for i, p in (await _live_api_keys(headscale)).items() if i not in before}
                return new if list(new.values()) == [raw_api_key_prefix(working)] else None

            await eventually(only_the_working_key_is_new, timeout=30,
                             what=f"the key of the mint whose outcome was lost ({proxy.injected}) to be expired")
            await admin.delete(TAILNET, name)
            await eventually(lambda: gone(admin, TAILNET, name), what="the Tailnet to be deleted by its finalizer")
