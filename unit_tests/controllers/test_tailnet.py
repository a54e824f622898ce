"""The Tailnet reconciler on the fake client and a fake Headscale: key lifecycle, every Ready reason,
and no write when nothing changed."""

from __future__ import annotations

import base64
import contextlib
from typing import Any

import pytest

from tailnet_operator.controllers.kinds import TAILNET
from tailnet_operator.names import FINALIZER
from tailnet_operator.runtime import SECRET, TransportError
from tailnet_operator.runtime.errors import Forbidden, ServerError

from .harness import NAMESPACE, World


async def test_first_reconcile_mints_a_working_key_from_the_bootstrap_key_and_reports_connected() -> None:
    world = World()
    bootstrap = world.bootstrap_secret()
    world.add_tailnet()

    result = await world.reconcile_tailnet()

    working = world.working_key()
    assert working != bootstrap and world.headscale.live(working)
    assert world.condition("Ready")["reason"] == "Connected"
    assert world.condition("Reachable")["status"] == "True"
    assert world.condition("KeyValid")["status"] == "True"
    status = world.tailnet_obj()["status"]
    assert status["serverVersion"] == "v0.29.2"
    assert status["observedGeneration"] == 1
    assert status["apiKey"]["nextRotationAt"] == "2026-01-01T01:00:00Z"  # half of the 2h lifetime
    assert FINALIZER in world.tailnet_obj()["metadata"]["finalizers"]
    secret = world.working_secret()
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == world.tailnet_obj()["metadata"]["uid"]
    assert world.events.reasons == ["WorkingKeyMinted"]
    assert 1.0 <= result.requeue_after <= 300.0


async def test_a_second_reconcile_with_nothing_changed_writes_nothing() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet()
    await world.reconcile_tailnet()
    writes = list(world.kube.writes)
    ready = world.condition("Ready")

    world.clock.advance(60)
    await world.reconcile_tailnet()

    assert world.kube.writes == writes
    assert world.condition("Ready") == ready  # lastTransitionTime kept
    assert world.events.reasons == ["WorkingKeyMinted"]


async def test_last_contact_is_refreshed_once_per_resync_period_only() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet(lifetime="48h")
    await world.reconcile_tailnet()
    first = world.tailnet_obj()["status"]["lastContactTime"]
    ready = world.condition("Ready")

    world.clock.advance(301)
    await world.reconcile_tailnet()

    assert world.tailnet_obj()["status"]["lastContactTime"] != first
    assert world.kube.writes[-1] == ("apply", "Tailnet", "tn", "status")
    assert world.condition("Ready")["lastTransitionTime"] == ready["lastTransitionTime"]


async def test_rotation_stores_the_new_key_before_it_expires_the_old_one() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet(lifetime="2h")
    await world.reconcile_tailnet()
    old = world.working_key()
    seen: dict[str, object] = {}

    async def after_store() -> None:
        secret = world.working_secret()
        assert secret is not None
        seen["stored"] = base64.b64decode(secret["data"]["apiKey"]).decode()
        seen["previous"] = secret["metadata"]["annotations"].get("tailnet.dev/previous-key-id")
        seen["old still live"] = world.headscale.live(old)

    world.tailnet.after_store = after_store
    world.clock.advance(3601)  # past half-life
    await world.reconcile_tailnet()

    new = world.working_key()
    assert new != old and world.headscale.live(new)
    assert seen["stored"] == new and seen["previous"] and seen["old still live"] is True
    assert not world.headscale.live(old)
    secret = world.working_secret()
    assert secret is not None and "tailnet.dev/previous-key-id" not in secret["metadata"]["annotations"]
    assert world.events.reasons == ["WorkingKeyMinted", "WorkingKeyRotated"]
    create = world.headscale.calls.index("POST /api/v1/apikey")
    assert world.headscale.calls.index("POST /api/v1/apikey/expire", create) > create


async def test_a_crash_between_storing_and_expiring_is_finished_by_the_next_reconcile() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet(lifetime="2h")
    await world.reconcile_tailnet()
    old = world.working_key()

    async def crash() -> None:
        raise RuntimeError("the process died here")

    world.tailnet.after_store = crash
    world.clock.advance(3601)
    with pytest.raises(RuntimeError):
        await world.reconcile_tailnet()
    assert world.headscale.live(old)
    secret = world.working_secret()
    assert secret is not None and secret["metadata"]["annotations"]["tailnet.dev/previous-key-id"]

    world.tailnet.after_store = None
    await world.reconcile_tailnet()

    assert not world.headscale.live(old)
    secret = world.working_secret()
    assert secret is not None and "tailnet.dev/previous-key-id" not in secret["metadata"]["annotations"]
    assert world.condition("Ready")["reason"] == "Connected"


async def test_a_rejected_working_key_is_replaced_from_the_bootstrap_key() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet()
    await world.reconcile_tailnet()
    old = world.working_key()
    for key in world.headscale.keys.values():
        if key.key == old:
            key.expired = True

    await world.reconcile_tailnet()

    assert world.working_key() != old and world.headscale.live(world.working_key())
    assert world.events.reasons == ["WorkingKeyMinted", "WorkingKeyRejected", "WorkingKeyMinted"]
    assert world.condition("Ready")["reason"] == "Connected"


@pytest.mark.parametrize(("setup", "reason", "key_valid", "reachable"), [
    ("no secret", "BootstrapSecretMissing", "False", "Unknown"),
    ("empty secret", "BootstrapKeyMissing", "False", "Unknown"),
    ("unknown key", "BootstrapKeyRejected", "False", "True"),
    ("connect", "Unreachable", "Unknown", "False"),
    ("tls", "TLSError", "Unknown", "False"),
    ("ca secret missing", "CASecretMissing", "False", "Unknown"),
])
async def test_each_failure_has_its_reason_and_is_retried(setup: str, reason: str, key_valid: str,
                                                           reachable: str) -> None:
    world = World()
    spec: dict[str, Any] = {}
    if setup == "empty secret":
        world.bootstrap_secret("")
    elif setup == "unknown key":
        world.bootstrap_secret("hskey-api-000000000000-not-a-key")
    elif setup != "no secret":
        world.bootstrap_secret()
    if setup in ("connect", "tls"):
        world.headscale.down = setup
    if setup == "ca secret missing":
        spec["caSecretRef"] = {"namespace": NAMESPACE, "name": "ca", "key": "ca.crt"}
    world.add_tailnet(**spec)

    result = await world.reconcile_tailnet()

    assert (world.condition("Ready")["status"], world.condition("Ready")["reason"]) == ("False", reason)
    assert world.condition("KeyValid")["status"] == key_valid
    assert world.condition("Reachable")["status"] == reachable
    assert result.requeue_after == 10.0
    assert world.working_secret() is None

    writes = list(world.kube.writes)
    await world.reconcile_tailnet()
    assert world.kube.writes == writes, "the same failure again writes nothing"


async def test_headscale_refusing_to_mint_is_a_headscale_error() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet()
    world.headscale.refuse["POST /api/v1/apikey"] = (500, 13, "database is locked")
    await world.reconcile_tailnet()

    assert world.condition("Ready")["reason"] == "HeadscaleError"


async def test_an_invalid_spec_is_reported_and_not_retried() -> None:
    world = World()
    world.kube.add(TAILNET, {"metadata": {"name": "tn"}, "spec": {"loginURL": "not a url"}})

    result = await world.reconcile_tailnet()

    assert world.condition("Ready")["reason"] == "InvalidSpec"
    assert result.requeue_after == 0
    assert world.headscale.calls == []


async def test_deleting_a_tailnet_expires_its_key_and_releases_the_finalizer() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet()
    await world.reconcile_tailnet()
    working = world.working_key()

    await world.kube.delete(TAILNET, "tn")
    assert world.tailnet_obj()["metadata"]["deletionTimestamp"]
    await world.reconcile_tailnet()

    assert not world.headscale.live(working)
    assert world.kube.get(TAILNET, "tn") is None
    assert world.events.reasons[-1] == "WorkingKeyExpired"
    assert world.kube.get(SECRET, "bootstrap", NAMESPACE) is not None


@pytest.mark.parametrize(("failure", "expired"), [
    (TransportError("POST: connect failed", unsent=True), True),
    (Forbidden(403, "Forbidden", "secrets is forbidden"), True),
    (TransportError("POST: timed out"), False),  # may have been written: the key must stay usable
    (ServerError(500, "InternalError", "etcdserver: request timed out"), False),
])
async def test_a_working_key_whose_secret_was_certainly_not_written_is_expired(failure: Exception,
                                                                               expired: bool) -> None:
    world = World()
    bootstrap = world.bootstrap_secret()
    world.add_tailnet()
    apply = world.kube.apply

    async def failing(resource: Any, body: Any, **kwargs: Any) -> Any:
        if resource == SECRET and body["metadata"]["name"] != "bootstrap":
            raise failure
        return await apply(resource, body, **kwargs)

    world.kube.apply = failing  # type: ignore[method-assign]
    with pytest.raises(type(failure)):
        await world.reconcile_tailnet()

    minted = [k for k in world.headscale.keys.values() if k.key != bootstrap]
    assert len(minted) == 1 and minted[0].expired is expired


def uncertain_secret_writes(world: World, failures: list[Exception], *, land: bool = False) -> None:
    """The working key's Secret writes fail with ``failures`` in turn (then succeed); with ``land``
    each failed write is stored all the same (a timeout after etcd committed it)."""
    apply = world.kube.apply

    async def failing(resource: Any, body: Any, **kwargs: Any) -> Any:
        if resource == SECRET and body["metadata"]["name"] != "bootstrap" and failures:
            if land:
                await apply(resource, body, **kwargs)
            raise failures.pop(0)
        return await apply(resource, body, **kwargs)

    world.kube.apply = failing  # type: ignore[method-assign]


def minted_keys(world: World, bootstrap: str) -> list[Any]:
    return [k for k in world.headscale.keys.values() if k.key != bootstrap]


@pytest.mark.parametrize("land", [False, True])
async def test_a_working_key_whose_store_may_have_landed_is_stored_again_not_minted_again(land: bool) -> None:
    world = World()
    bootstrap = world.bootstrap_secret()
    world.add_tailnet()
    uncertain_secret_writes(world, [TransportError("PATCH: timed out"),
                                    ServerError(500, "InternalError", "etcdserver: request timed out"),
                                    TransportError("PATCH: connect failed", unsent=True)], land=land)
    for _ in range(3):  # once landed, the key is seen stored and nothing is written again
        with contextlib.suppress(TransportError, ServerError):
            await world.reconcile_tailnet()

    await world.reconcile_tailnet()

    [minted] = minted_keys(world, bootstrap)
    assert world.working_key() == minted.key and world.headscale.live(minted.key), \
        "a retry that certainly failed must not expire a key an earlier uncertain write may have stored"
    assert world.condition("Ready")["reason"] == "Connected"
    assert world.events.reasons == ["WorkingKeyMinted"]


async def test_a_rotation_whose_store_may_have_landed_is_finished_with_the_same_key() -> None:
    world = World()
    bootstrap = world.bootstrap_secret()
    world.add_tailnet(lifetime="2h")
    await world.reconcile_tailnet()
    old = world.working_key()
    uncertain_secret_writes(world, [TransportError("PATCH: timed out"), TransportError("PATCH: timed out")])
    world.clock.advance(3601)  # past half-life
    for _ in range(2):
        with pytest.raises(TransportError):
            await world.reconcile_tailnet()

    await world.reconcile_tailnet()

    keys = minted_keys(world, bootstrap)
    assert len(keys) == 2, "one key minted at first, one for the rotation: no more"
    new = world.working_key()
    assert new != old and world.headscale.live(new) and not world.headscale.live(old)
    assert world.events.reasons == ["WorkingKeyMinted", "WorkingKeyRotated"]


async def test_a_new_working_key_that_does_not_work_is_never_stored() -> None:
    """The key Headscale returns is proved with a call of its own before it is trusted."""
    world = World()
    world.bootstrap_secret()
    world.add_tailnet()
    world.headscale.expire_new_api_keys = True

    await world.reconcile_tailnet()

    assert world.working_secret() is None, "a key that Headscale refuses was stored as the working key"
    assert world.condition("Ready")["status"] == "False"


async def test_a_secret_outside_the_operators_namespace_is_never_read() -> None:
    world = World()
    world.kube.add(SECRET, {"metadata": {"name": "bootstrap", "namespace": "someone-else"},
                            "data": {"apiKey": base64.b64encode(world.headscale.add_key().encode()).decode()}})
    world.add_tailnet(bootstrapKeySecretRef={"namespace": "someone-else", "name": "bootstrap"})

    await world.reconcile_tailnet()

    ready = world.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "SecretOutsideOperatorNamespace")
    assert f"operator's namespace {NAMESPACE}" in ready["message"]
    assert world.headscale.calls == [], "Headscale was contacted with another namespace's Secret"


async def test_http_urls_need_the_opt_in_and_then_carry_a_warning_condition() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet(loginURL="http://headscale.test:8080", allowInsecureHTTP=True)

    await world.reconcile_tailnet()

    assert world.condition("Ready")["status"] == "True"
    insecure = world.condition("InsecureTransport")
    assert (insecure["status"], insecure["reason"]) == ("True", "AllowInsecureHTTP")
    assert "in clear" in insecure["message"]


async def test_an_http_url_without_the_opt_in_is_an_invalid_spec() -> None:
    world = World()
    world.bootstrap_secret()
    world.add_tailnet(loginURL="http://headscale.test:8080")

    await world.reconcile_tailnet()

    ready = world.condition("Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "must be an https:// URL" in ready["message"] and "allowInsecureHTTP" in ready["message"]
