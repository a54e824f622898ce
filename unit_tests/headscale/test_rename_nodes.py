"""``HeadscaleClient.rename_nodes``: a name handed from one node to another in one Headscale batch.

The server here holds each request until the test lets it answer, as Headscale holds a node write
until its NodeStore batch is applied: what matters is which requests were pending together."""

from __future__ import annotations

import asyncio

import pytest

from tailnet_operator.headscale import HeadscaleClient, MockTransport, Request, Response, ServerError

from .test_client_unit import KEY, NODE, URL, grpc, ok


class Batching:
    """Applies the renames pending together in the order they arrived, refusing a name another
    node holds (as Headscale's NodeStore does); a batch is applied once ``size`` requests wait."""

    def __init__(self, names: dict[str, str], size: int) -> None:
        self.names, self.size = names, size
        self.arrived: list[str] = []
        self.pending: list[tuple[str, str, asyncio.Future[Response]]] = []

    async def __call__(self, request: Request) -> Response:
        *_, node_id, _, name = request.url.split("/")
        self.arrived.append(f"{node_id}->{name}")
        answer: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self.pending.append((node_id, name, answer))
        if len(self.pending) >= self.size:
            self.apply()
        return await asyncio.wait_for(answer, 5)

    def apply(self) -> None:
        for node_id, name, answer in self.pending:
            if any(other == name for n, other in self.names.items() if n != node_id):
                answer.set_result(grpc(500, 13, f"node name is not unique: {name}"))
                continue
            self.names[node_id] = name
            answer.set_result(ok({"node": {**NODE, "id": node_id, "givenName": name}}))
        self.pending.clear()


async def test_the_renames_of_a_hand_over_are_pending_together_and_applied_in_their_order() -> None:
    server = Batching({"7": "shop", "9": "shop-x1"}, size=2)
    async with HeadscaleClient(URL, KEY, transport=MockTransport(server), backoff=0,
                               server_version="v0.29.2") as hsc:
        renamed = await hsc.rename_nodes([("7", "shop-old7")], ("9", "shop"))

    assert server.arrived == ["7->shop-old7", "9->shop"]
    assert [(n.id, n.given_name) for n in renamed] == [("7", "shop-old7"), ("9", "shop")]
    assert server.names == {"7": "shop-old7", "9": "shop"}


async def test_a_rename_that_overtook_the_one_freeing_its_name_is_sent_again_after_it() -> None:
    server = Batching({"7": "shop", "9": "shop-x1"}, size=1)
    refused_once = asyncio.Event()

    async def overtaking(request: Request) -> Response:
        if "/node/7/" in request.url:  # the freeing rename reaches Headscale after the taking one
            await asyncio.wait_for(refused_once.wait(), 5)
        answer = await server(request)
        if answer.status != 200:
            refused_once.set()
        return answer

    async with HeadscaleClient(URL, KEY, transport=MockTransport(overtaking), backoff=0,
                               server_version="v0.29.2") as hsc:
        renamed = await hsc.rename_nodes([("7", "shop-old7")], ("9", "shop"))

    assert server.arrived == ["9->shop", "7->shop-old7", "9->shop"]
    assert [(n.id, n.given_name) for n in renamed] == [("7", "shop-old7"), ("9", "shop")]


async def test_a_refused_freeing_rename_is_raised_and_the_name_stays() -> None:
    server = Batching({"7": "shop", "9": "shop-x1", "3": "shop-old7"}, size=2)
    async with HeadscaleClient(URL, KEY, transport=MockTransport(server), backoff=0,
                               server_version="v0.29.2") as hsc:
        with pytest.raises(ServerError, match="not unique: shop-old7"):
            await hsc.rename_nodes([("7", "shop-old7")], ("9", "shop"))
    assert server.names["7"] == "shop" and server.names["9"] == "shop-x1"
    assert server.arrived == ["7->shop-old7", "9->shop"]


async def test_given_the_last_nodes_name_the_renames_follow_a_write_that_changes_nothing() -> None:
    """A rename of the taking node to the name it has is answered once Headscale applied its batch:
    the hand-over is sent then, when the next batch is furthest away."""
    server = Batching({"7": "shop", "9": "shop-x1"}, size=1)
    async with HeadscaleClient(URL, KEY, transport=MockTransport(server), backoff=0,
                               server_version="v0.29.2") as hsc:
        renamed = await hsc.rename_nodes([("7", "shop-old7")], ("9", "shop"), last_name="shop-x1")

    assert server.arrived == ["9->shop-x1", "7->shop-old7", "9->shop"]
    assert [(n.id, n.given_name) for n in renamed] == [("7", "shop-old7"), ("9", "shop")]
