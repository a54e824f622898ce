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

from hack.chaos import KINDS, ROUNDS_ENV, run_chaos, seed_from_env
from hack.localenv import Environment

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1800)
def test_every_round_converges_with_nothing_orphaned_and_the_bootstrap_key_unused(
    environment: Environment,
) -> None:
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is needed to cut the DERP connection")
    rounds = int(os.environ.get(ROUNDS_ENV, str(len(KINDS))))
    seed = seed_from_env()
    report = run_chaos(rounds, seed, env=environment)
    print(report.summary())
    assert not report.failure, report.summary()
    assert report.rounds_survived == rounds
    assert sum(report.kills.values()) == rounds
    if rounds >= len(KINDS):
        assert set(report.kills) == set(KINDS), "every kind of kill is drawn in a run of at least len(KINDS) rounds"
    assert report.orphans == []
    assert report.minted == 1 and report.bootstrap_uses == 0, report.summary()
