"""The ownership marker and the orphan sweep against a real Headscale (v0.29.2, or the release in
``$TAILNET_HEADSCALE_VERSION``: 0.26.1, 0.27.1 and 0.28.0 pass too) and real tailscaled.

Keys and nodes with and without the installation's marker (``installation_tag``) are made on one
server, and keys with another installation's marker and with the marker all installations shared
before (``LEGACY_OWNER_TAG``); the sweep must expire and delete exactly the ones with its own marker
that no CR refers to, and nothing else.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import AsyncIterator

import pytest

from e2e.conftest import TailscaleFactory
from e2e.test_headscale_client import eventually, node_named
from hack.localenv import Headscale
from tailnet_operator.controllers.sweep import list_orphans
from tailnet_operator.headscale import (
    LEGACY_OWNER_TAG,
    HeadscaleClient,
    References,
    find_orphans,
    installation_tag,
    owned_node,
    sweep_orphans,
)

pytestmark = pytest.mark.integration

OURS = installation_tag(str(uuid.uuid4()))
THEIRS = installation_tag(str(uuid.uuid4()))
"""The marker of another installation sharing the server."""

# The marker is in no tagOwners entry: Headscale must accept it on a tag-only key anyway.
POLICY = """{
  "tagOwners": {"tag:gone": [], "tag:live": [], "tag:theirs": []},
  "acls": [{"action": "accept", "src": ["tag:live"], "dst": ["tag:gone:*"]}],
}"""


@pytest.fixture
async def client(headscale: Headscale) -> AsyncIterator[HeadscaleClient]:
    async with HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle,
                               owner_tag=OURS) as hsc:
        yield hsc


async def test_the_sweep_removes_only_the_operators_keys_and_nodes_no_cr_refers_to(
    client: HeadscaleClient, headscale: Headscale, tailscale_nodes: TailscaleFactory
) -> None:
    await client.set_policy(POLICY)
    life = dt.timedelta(hours=1)

    async def key(*tags: str, ephemeral: bool = True) -> str:
        made = await client.create_preauth_key(acl_tags=list(tags), reusable=True, ephemeral=ephemeral,
                                               expiration=life)
        return made.key

    # the operator's, for a CR that is gone: the key expires, its ephemeral node goes
    gone = await key("tag:gone", OURS)
    # the operator's, for a CR that exists (its Secret records the key; the CR has tag:live)
    live = await key("tag:live", OURS)
    # the operator's, not ephemeral (a gateway kept under deletionPolicy Retain): its node stays
    kept = await key("tag:gone", OURS, ephemeral=False)
    # not the operator's: the same tag as the gone CR, but no marker
    theirs = await key("tag:gone")
    theirs_other = await key("tag:theirs")
    # another installation's, and one from before markers were per installation: not this one's
    await key("tag:gone", THEIRS)
    await key("tag:gone", LEGACY_OWNER_TAG)

    for hostname, authkey in (("gone-agent", gone), ("live-agent", live), ("kept-router", kept),
                              ("their-node", theirs), ("their-other", theirs_other)):
        tailscale_nodes(hostname, headscale, authkey=authkey)
    nodes = {}
    for hostname in ("gone-agent", "live-agent", "kept-router", "their-node", "their-other"):
        nodes[hostname] = await eventually(lambda h=hostname: node_named(client, h), timeout=60,  # type: ignore[misc]
                                           what=f"{hostname} registered")
    # Headscale keeps the marker on the node, beside the CR's tag (0.28+ tags, before forced tags)
    assert set(nodes["gone-agent"].tags) == {"tag:gone", OURS}
    assert owned_node(nodes["kept-router"], OURS) and not owned_node(nodes["their-node"], OURS)

    keys = {k.acl_tags: k for k in await client.list_preauth_keys()}
    live_id = keys[("tag:live", OURS)].id
    refs = References(key_ids=frozenset({live_id}), tags=frozenset({"tag:live"}))

    # a grace longer than the objects' age: nothing yet (a key is made before its Secret records it)
    assert not await find_orphans(client, refs, owner_tag=OURS, grace=dt.timedelta(minutes=10))

    orphans = await list_orphans(client, refs)
    # the gone CR's key and the not-ephemeral one (a key no CR records is an orphan either way)
    assert {k.acl_tags for k in orphans.keys} == {("tag:gone", OURS)}
    assert len(orphans.keys) == 2
    assert [n.name for n in orphans.nodes] == ["gone-agent"]

    swept = await sweep_orphans(client, orphans)
    assert len(swept.keys) == 2 and len(swept.nodes) == 1

    now = dt.datetime.now(dt.UTC)
    after = await client.list_preauth_keys()
    expired = {k.id for k in after if k.expiration is not None and k.expiration <= now}
    assert expired == {k.id for k in orphans.keys}, "exactly the orphan keys are expired"
    names = {n.name for n in await client.list_nodes()}
    assert names == {"live-agent", "kept-router", "their-node", "their-other"}
    assert not await list_orphans(client, refs), "a second look finds nothing: expired keys are not orphans"
