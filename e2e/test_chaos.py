"""A short seeded chaos run (hack/chaos.py; ``make chaos`` runs it at length).

Kills, one per round, the operator leader, kube-apiserver, etcd, Headscale, an agent or the DERP
connection while changes are in flight, and after each round requires every CR Ready again within
the bound, no orphaned pre-auth key or node once the operators' orphan sweep (short grace here)
had its chance, no more API keys left than leaders that ended mid-rotation, the bootstrap key never
needed again and the rendered policy live. ``TAILNET_CHAOS_SEED`` repeats a run (the seed is
printed), ``TAILNET_CHAOS_ROUNDS`` sets the rounds (default: each kind of kill once).

A kind of kill this machine cannot make (the DERP kill without root or ``ss``) is left out of the
run, printed with its reason, and reported as a skip of its own test below, so the run's skip
summary (and ``$TAILNET_NO_SKIPS``) sees it.

The run starts its own etcd, kube-apiserver, Headscale, router and operators (in the session's
environment, so the leak check covers them) and stops them at its end: its kills never reach
another test's components.
"""

from __future__ import annotations

import os

import pytest

from hack.chaos import KINDS, ROUNDS_ENV, run_chaos, seed_from_env, unavailable_kinds
from hack.localenv import Environment

pytestmark = pytest.mark.integration


def test_every_kind_of_kill_can_be_made_here() -> None:
    """A machine limitation, not a design choice: the chaos run below goes on without the kind."""
    if dropped := unavailable_kinds():
        pytest.skip("chaos kills left out: " + "; ".join(f"{k} ({why})" for k, why in dropped.items()))


@pytest.mark.timeout(1800)
def test_every_round_converges_with_nothing_orphaned_and_the_bootstrap_key_unused(
    environment: Environment,
) -> None:
    dropped = unavailable_kinds()
    for kind, why in dropped.items():
        print(f"chaos: kind {kind!r} LEFT OUT of this run: {why}")
    kinds = tuple(k for k in KINDS if k not in dropped)
    rounds = int(os.environ.get(ROUNDS_ENV, str(len(kinds))))
    seed = seed_from_env()
    report = run_chaos(rounds, seed, env=environment, kinds=kinds)
    print(report.summary())
    assert report.rounds_survived == rounds, report.summary()
    assert sum(report.kills.values()) == rounds
    if rounds >= len(kinds):
        assert set(report.kills) == set(kinds), "every kind of kill is drawn in a run of at least len(kinds) rounds"
    assert report.minted == 1 and report.bootstrap_uses == 0, report.summary()
    assert not report.orphans, report.summary()
    # An API key minted by a leader that ended before storing it carries no marker and expires on
    # its own (docs/reliability.md, "Chaos"): at most one per such leader.
    assert len(report.api_keys_left) <= report.api_key_bound, report.summary()
    assert not report.failure, report.summary()
