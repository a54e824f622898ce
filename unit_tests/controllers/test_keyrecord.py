"""The one key record (working API key and pre-auth keys) and the last step of their rotation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tailnet_operator.controllers.access import KEY_FIELD, StoredKey
from tailnet_operator.controllers.keyrecord import KEY_ID, PREVIOUS_KEY_ID, finish
from tailnet_operator.controllers.preauth import AUTH_KEY_FIELD, AuthKey

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def working(previous_id: str = "") -> StoredKey:
    return StoredKey(key="hskey-api-secret", id="7", prefix="hskey-api-abc", created_at=T0,
                     expires_at=T0 + timedelta(hours=2), previous_id=previous_id)


def preauth(previous_id: str = "") -> AuthKey:
    return AuthKey(key="hskey-auth-secret", id="9", prefix="hskey-auth-***", created_at=T0,
                   expires_at=T0 + timedelta(hours=24), login_url="https://hs.example", tag="tag:a",
                   previous_id=previous_id, previous_tag="tag:old" if previous_id else "")


def test_both_kinds_of_key_read_back_what_they_wrote_under_their_own_data_field() -> None:
    for key, field in ((working("6"), KEY_FIELD), (preauth("8"), AUTH_KEY_FIELD)):
        secret = key.secret({"name": "s", "namespace": "ns", "labels": {"a": "b"}})
        assert set(secret["data"]) == {field}
        assert secret["metadata"]["annotations"][KEY_ID] == key.id
        assert secret["metadata"]["annotations"][PREVIOUS_KEY_ID] == key.previous_id
        assert type(key).from_secret(secret) == key


def test_a_record_with_a_damaged_annotation_reads_as_none() -> None:
    secret = preauth().secret({"name": "s"})
    del secret["metadata"]["annotations"]["tailnet.dev/login-url"]
    assert AuthKey.from_secret(secret) is None
    assert StoredKey.from_secret({"metadata": {"name": "s"}, "data": {}}) is None


def test_rotation_is_due_at_half_the_lifetime() -> None:
    assert working().rotation_due == T0 + timedelta(hours=1)
    assert preauth().rotation_due == T0 + timedelta(hours=12)


async def test_finish_expires_the_previous_key_before_it_forgets_it() -> None:
    steps: list[str] = []

    async def expire(key: AuthKey) -> None:
        steps.append(f"expire {key.previous_id}")

    async def store(key: AuthKey) -> None:
        steps.append(f"store previous={key.previous_id!r} tag={key.previous_tag!r}")

    done = await finish(preauth("8"), store, expire)

    assert steps == ["expire 8", "store previous='' tag=''"]
    assert done.previous_id == "" and done.previous_tag == ""


async def test_finish_without_a_previous_key_does_nothing() -> None:
    async def fail(key: StoredKey) -> None:
        raise AssertionError("nothing to do")

    key = working()
    assert await finish(key, fail, fail) is key


async def test_a_failed_expiry_keeps_the_previous_key_recorded() -> None:
    stored: list[StoredKey] = []

    async def expire(key: StoredKey) -> None:
        raise RuntimeError("Headscale is down")

    async def store(key: StoredKey) -> None:
        stored.append(key)

    with pytest.raises(RuntimeError):
        await finish(working("6"), store, expire)
    assert stored == [], "the record still names the previous key, so the next reconcile expires it"
