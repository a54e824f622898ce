"""One marker per installation: its form, and an orphan rule that sees only its own installation's."""

from __future__ import annotations

import datetime as dt

import pytest

from tailnet_operator.headscale import (
    LEGACY_OWNER_TAG,
    HeadscaleClient,
    MockTransport,
    Node,
    PreAuthKey,
    References,
    Response,
    check_marker,
    installation_tag,
    orphans_of,
)

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
OLD = "2025-12-31T00:00:00Z"
OURS = installation_tag("5b0e7a2c-1f3d-4e6a-9b8c-0d1e2f3a4b5c")
THEIRS = installation_tag("a9d8c7b6-5e4f-4a3b-8c2d-1e0f9a8b7c6d")


def key(key_id: str, *tags: str) -> PreAuthKey:
    return PreAuthKey.from_json({"id": key_id, "key": f"hskey-auth-{key_id}", "reusable": True, "ephemeral": True,
                                 "expiration": "2026-01-02T00:00:00Z", "createdAt": OLD, "aclTags": list(tags)})


def node(node_id: str, key_id: str, *tags: str) -> Node:
    return Node.from_json({"id": node_id, "name": f"n{node_id}", "tags": list(tags), "createdAt": OLD,
                           "preAuthKey": {"id": key_id}})


def test_the_marker_is_made_from_the_tailnets_uid() -> None:
    assert OURS == "tag:tailnet-operator-5b0e7a2c1f3d4e6a"
    assert OURS != THEIRS
    assert installation_tag("5B0E7A2C-1F3D-4E6A-9B8C-0D1E2F3A4B5C") == OURS
    for bad in ("", "tailnet-system", "5b0e7a2c-1f3d", "5b0e7a2c-1f3d-4e6a-9b8c-0d1e2f3a4b5z"):
        with pytest.raises(ValueError, match="Tailnet's uid"):
            installation_tag(bad)


def test_only_an_installations_marker_is_one() -> None:
    assert check_marker(OURS) == OURS
    for bad in (LEGACY_OWNER_TAG, "tag:tailnet-operator-", "tag:egress-db", OURS + "0"):
        with pytest.raises(ValueError, match="not an installation's marker"):
            check_marker(bad)


def test_an_orphan_is_only_ever_the_installations_own() -> None:
    keys = [key("1", "tag:egress-gone", OURS), key("2", "tag:egress-gone", THEIRS),
            key("3", "tag:egress-gone", LEGACY_OWNER_TAG), key("4", "tag:egress-gone")]
    nodes = [node("1", "1", "tag:egress-gone", OURS), node("2", "2", "tag:egress-gone", THEIRS),
             node("3", "3", "tag:egress-gone", LEGACY_OWNER_TAG), node("4", "4", "tag:egress-gone")]

    orphans = orphans_of(keys, nodes, References(), now=NOW, owner_tag=OURS)

    assert [k.id for k in orphans.keys] == ["1"]
    assert [n.id for n in orphans.nodes] == ["1"]
    assert [k.id for k in orphans_of(keys, nodes, References(), now=NOW, owner_tag=THEIRS).keys] == ["2"]
    with pytest.raises(ValueError):
        orphans_of(keys, nodes, References(), now=NOW, owner_tag=LEGACY_OWNER_TAG)


def test_a_client_acts_for_an_installation_only_when_told() -> None:
    client = HeadscaleClient("https://headscale.test", "hskey-api-x", transport=MockTransport(
        lambda request: Response(404, {}, b"")))
    with pytest.raises(ValueError, match="acts for no installation"):
        _ = client.owner_tag
    client.owner_tag = OURS
    assert client.owner_tag == OURS
    with pytest.raises(ValueError):
        client.owner_tag = LEGACY_OWNER_TAG
    assert HeadscaleClient("https://headscale.test", "hskey-api-x", owner_tag=THEIRS,
                           transport=MockTransport(lambda request: Response(404, {}, b""))).owner_tag == THEIRS
