"""Agents under continuous load through disruptions, on a real node (issue 24, "Done when").

Egress: a client pod sends an HTTP GET every 20 ms (a new connection each, 2 s deadline) through
the egress target's Service to a site host; it loses no request while the agent rolls out or its
pre-auth key rotates with one replica, nor while one of two replicas is deleted or its node is
drained. Ingress with two
replicas behind a shared address: none of the laptop's requests to the address is refused through
a rollout or a deleted pod (one open as the address moves is cut, one it catches in its handshake
may hang). Ingress: a
tailscaled laptop sends requests to an https and a tcp expose by the ingress's MagicDNS name; when
the agent rolls out, the name moves to the new node once its pod is ready (the old agent serves who
resolved the name before under another name while it drains), the load recovers, and the name is
kept (``status.node.name`` and the MagicDNS
name are ``spec.hostname`` again once it is done). The loads and disruptions are
``e2e/disruption.py``'s, which ``benchmarks/disruption.py`` also runs for the figures (durations
are measured there only). A node drain needs a second node: it runs on kind (``make e2e``) and
skips by design on the single local node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e.cluster import ClusterUnderTest
from e2e.conftest import TailscaleFactory
from e2e.disruption import (
    CUT,
    HUNG,
    EgressWorld,
    IngressLoad,
    IngressWorld,
    Outcome,
    Subject,
    disrupt,
    egress_world,
    ingress_world,
    schedulable_nodes,
)
from e2e.skips import skip_by_design
from hack.localenv import Headscale, SiteHost

pytestmark = [pytest.mark.integration, pytest.mark.cluster, pytest.mark.e2e, pytest.mark.quiet,
              pytest.mark.timeout(900)]


# Class-scoped worlds: each Tailnet applies its own policy to the one Headscale, so two alive at
# once would overwrite each other's policy every pass; the egress world is gone before the ingress's.
@pytest.fixture(scope="class")
def egress(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale, project_image: Any,
           module_site_host: Callable[[], SiteHost], module_tailscale_nodes: TailscaleFactory,
           ) -> Iterator[EgressWorld]:
    with egress_world(cluster, installed_operator, cluster_headscale, project_image.ref, module_site_host,
                      module_tailscale_nodes) as world:
        yield world


@pytest.fixture(scope="class")
def ingress(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale, project_image: Any,
            module_tailscale_nodes: TailscaleFactory, tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[IngressWorld]:
    with ingress_world(cluster, installed_operator, cluster_headscale, project_image.ref,
                       tmp_path_factory.mktemp("ingress"), module_tailscale_nodes) as world:
        yield world


@pytest.fixture(scope="class")
def shared_ingress(cluster: ClusterUnderTest, installed_operator: str, cluster_headscale: Headscale,
                   project_image: Any, module_tailscale_nodes: TailscaleFactory,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[IngressWorld]:
    with ingress_world(cluster, installed_operator, cluster_headscale, project_image.ref,
                       tmp_path_factory.mktemp("shared-ingress"), module_tailscale_nodes, shared=True) as world:
        yield world


def _explain(subject: Subject, outcome: Outcome) -> str:
    return f"{outcome}\n{subject.explain()}"


def _lost(outcome: Outcome) -> dict[str, int]:
    return {stream: t.lost for stream, t in outcome.streams.items()}


class TestEgress:
    def test_egress_with_one_replica_loses_nothing_on_a_rollout(
            self, egress: EgressWorld, cluster_headscale: Headscale) -> None:
        egress.scale(1)
        outcome = disrupt(egress.subject, cluster_headscale, "rollout", egress.load)
        assert outcome.streams["http"].sent > 0
        assert _lost(outcome) == {"http": 0}, _explain(egress.subject, outcome)

    def test_egress_with_one_replica_loses_nothing_on_a_key_rotation(
            self, egress: EgressWorld, cluster_headscale: Headscale) -> None:
        egress.scale(1)
        before = {p["metadata"]["uid"] for p in egress.subject.pods()}
        outcome = disrupt(egress.subject, cluster_headscale, "key rotation", egress.load)
        assert _lost(outcome) == {"http": 0}, _explain(egress.subject, outcome)
        assert {p["metadata"]["uid"] for p in egress.subject.pods()} == before, "a rotation restarts no agent"

    def test_egress_with_two_replicas_loses_nothing_when_one_pod_is_deleted(
            self, egress: EgressWorld, cluster_headscale: Headscale) -> None:
        egress.scale(2)
        try:
            outcome = disrupt(egress.subject, cluster_headscale, "pod deleted", egress.load)
            assert _lost(outcome) == {"http": 0}, _explain(egress.subject, outcome)
        finally:
            egress.scale(1)

    def test_egress_with_two_replicas_loses_nothing_when_a_node_is_drained(
            self, egress: EgressWorld, cluster_headscale: Headscale) -> None:
        nodes = schedulable_nodes(egress.subject.cluster)
        if len(nodes) < 2:
            skip_by_design(f"a drain needs a second node for the evicted agent; this cluster schedules on {nodes} "
                           "(make e2e runs it on kind's two workers)")
        egress.scale(2)
        try:
            outcome = disrupt(egress.subject, cluster_headscale, "node drained", egress.load)
            assert _lost(outcome) == {"http": 0}, _explain(egress.subject, outcome)
        finally:
            egress.scale(1)


class TestIngress:
    """The name moves in two Headscale renames (the old node's away, then the new node's to the
    hostname: Headscale refuses a name another node holds and has no swap), sent together so that
    they land in one of Headscale's batches of node changes and its peers never see the name
    unheld; the old node serves under its new name while it drains."""

    def test_ingress_keeps_its_name_and_loses_nothing_on_a_rollout(
            self, ingress: IngressWorld, cluster_headscale: Headscale) -> None:
        outcome = disrupt(ingress.subject, cluster_headscale, "rollout", ingress.load)
        assert all(t.sent > 0 for t in outcome.streams.values()), outcome
        assert _lost(outcome) == {"https": 0, "tcp": 0}, _explain(ingress.subject, outcome)
        # disrupt() waited for the name and for the load's recovery.
        assert ingress.subject.named(), ingress.subject.get().get("status")


MOVES = {"rollout": 2, "pod deleted": 1}
"""How often the shared address can move: a rollout replaces both replicas (the primary's successor
may be the other old one), a deleted pod is one."""


class TestSharedIngress:
    """Two replicas behind a shared address (``spec.sharedAddress``): the laptop's requests go to the
    address, which Headscale sends to one replica and moves when that one goes (the replica withdraws
    its route at SIGTERM and serves until no new connection comes). No request may be refused; the
    one open on a stream at the instant the address moves is cut (at most one per move), and one
    whose handshake the move catches may hang past the deadline (its SYN went to the replica that
    withdrew; docs/benchmarks.md counts them: 0-2 per stream on kind). The hangs that came from the
    agent's own TIME-WAIT (docs/decisions.md) are gone, and the single ingress loses none."""

    @pytest.mark.parametrize("disruption", ["rollout", "pod deleted"])
    def test_replicas_behind_a_shared_address_refuse_no_request(
            self, shared_ingress: IngressWorld, cluster_headscale: Headscale, disruption: str) -> None:
        loads: list[IngressLoad] = []

        def load() -> IngressLoad:
            loads.append(shared_ingress.load())
            return loads[-1]

        outcome = disrupt(shared_ingress.subject, cluster_headscale, disruption, load)
        assert all(t.sent > 0 for t in outcome.streams.values()), outcome
        failures = loads[-1].failures
        failed = {stream: dict(kinds) for stream, kinds in failures.items() if set(kinds) - {HUNG, *CUT}}
        assert not failed, f"requests refused or failed otherwise: {failed}\n" + _explain(
            shared_ingress.subject, outcome)
        cut = {stream: sum(kinds[k] for k in CUT) for stream, kinds in failures.items()}
        # A stream has one request open at a time, so each move of the address cuts at most one.
        assert all(n <= MOVES[disruption] for n in cut.values()), (cut, outcome)
        print(f"\n{disruption}: lost {_lost(outcome)}: {cut} cut by a move of the address, the rest hung "
              "(a handshake the move caught)")
