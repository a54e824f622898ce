"""The record of keys minted whose store had an uncertain outcome (controllers/unconfirmed.py)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import pytest

from tailnet_operator.controllers.unconfirmed import Unconfirmed, Unseen
from tailnet_operator.runtime import TransportError


@dataclass(frozen=True)
class Key:
    id: str


async def test_an_uncertain_store_is_remembered_until_the_secret_is_seen_holding_the_key() -> None:
    record: Unconfirmed[Key] = Unconfirmed()
    abandoned: list[Key] = []

    async def timed_out(key: Key) -> None:
        raise TransportError("PATCH: timed out")

    async def unsent(key: Key) -> None:
        raise TransportError("PATCH: connect failed", unsent=True)

    async def abandon(key: Key) -> None:
        abandoned.append(key)

    with pytest.raises(TransportError):
        await record.store("ns/s", Key("1"), timed_out, abandon)
    assert record.pending("ns/s", stored_id=None) == Key("1")
    with pytest.raises(TransportError):
        await record.store("ns/s", Key("1"), unsent, abandon)
    assert abandoned == [], "the first write may have landed: never abandoned later"
    assert record.pending("ns/s", stored_id="0") == Key("1")
    assert record.pending("ns/s", stored_id="1") is None and record.held("ns/s") is None


async def test_a_store_that_certainly_wrote_nothing_abandons_a_new_key() -> None:
    record: Unconfirmed[Key] = Unconfirmed()
    abandoned: list[Key] = []

    async def unsent(key: Key) -> None:
        raise TransportError("PATCH: connect failed", unsent=True)

    async def abandon(key: Key) -> None:
        abandoned.append(key)

    with pytest.raises(TransportError):
        await record.store("ns/s", Key("2"), unsent, abandon)
    assert abandoned == [Key("2")] and record.held("ns/s") is None


@dataclass(frozen=True)
class Listed:
    id: str
    expiration: dt.datetime | None


def test_a_create_whose_answer_was_lost_is_found_by_its_expiration_and_only_it() -> None:
    asked = dt.datetime(2026, 12, 3, 6, 0, 0, 123456, tzinfo=dt.UTC)
    record = Unseen()
    record.asking("tn", asked)
    record.asking("tn", asked + dt.timedelta(seconds=1))
    record.done("tn", {asked + dt.timedelta(seconds=1)})
    listed = [
        Listed("1", asked.replace(microsecond=123000)),  # a store that keeps milliseconds
        Listed("2", asked + dt.timedelta(milliseconds=2)),  # another mint
        Listed("3", asked),  # the key in use
        Listed("4", None),
    ]
    assert Unseen.made_by(record.asked("tn"), listed, keep={"3"}) == [listed[0]]
    record.done("tn", record.asked("tn"))
    assert record.asked("tn") == frozenset()
