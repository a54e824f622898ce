"""A short seeded chaos run (hack/chaos.py; ``make chaos`` runs it at length).

Kills, one per round, the operator leader, kube-apiserver, etcd, Headscale, an agent or the DERP
connection while changes are in flight, and after each round requires every CR Ready again within
the bound, no orphaned pre-auth key or node, the bootstrap key never needed again and the rendered
policy live. ``TAILNET_CHAOS_SEED`` repeats a run (the seed is printed), ``TAILNET_CHAOS_ROUNDS``
sets the rounds (default 6: each kind of kill once).

The run starts its own etcd, kube-apiserver, Headscale, router and operators (in the session's
environment, so the leak check covers them) and stops them at its end: its kills never reach
another test's components.
"""

from __future__ import annotations

import os
import shutil

import pytest

from hack.chaos import KINDS, ROUNDS_ENV, is_known, run_chaos, seed_from_env
from hack.localenv import Environment

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1800)
def test_every_round_converges_with_nothing_orphaned_and_the_bootstrap_key_unused(
    environment: Environment,
) -> None:
    # Cutting the DERP connection destroys sockets with `ss -K`: root (CAP_NET_ADMIN) and iproute2.
    kinds = KINDS if os.geteuid() == 0 and shutil.which("ss") else tuple(k for k in KINDS if k != "derp")
    rounds = int(os.environ.get(ROUNDS_ENV, str(len(kinds))))
    seed = seed_from_env()
    report = run_chaos(rounds, seed, env=environment, kinds=kinds)
    print(report.summary())
    assert report.rounds_survived == rounds, report.summary()
    assert sum(report.kills.values()) == rounds
    if rounds >= len(kinds):
        assert set(report.kills) == set(kinds), "every kind of kill is drawn in a run of at least len(kinds) rounds"
    assert report.minted == 1 and report.bootstrap_uses == 0, report.summary()
    assert not [o for o in report.orphans if not is_known(o)], report.summary()
    if report.orphans:
        # Known (docs/reliability.md, "Chaos"): a key whose Secret write may have been stored (timed
        # out or a 5xx while kube-apiserver or etcd went down) is kept rather than risk a Secret that
        # holds a dead key (the orphan sweep expires such pre-auth keys after its grace); an ephemeral
        # node offline across a Headscale kill may never be aged out by Headscale.
        pytest.xfail("known orphans (keys whose Secret write may have been stored, nodes not aged out): "
                     + "; ".join(report.orphans))
    assert not report.failure, report.summary()
