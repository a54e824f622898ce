"""The policy pipeline at scale: parse + derive + render + diff for a base of ``--rules`` rules
(HuJSON with comments) and ``--egresses`` TailnetEgress / ``--sites`` TailnetSite CRs.

Each step is timed over ``--repeat`` runs (median), as the Policy reconciler runs it: the CRs
are validated models (the cache parses each once per resourceVersion), derive, render (the
base's HuJSON text with the derived entries inserted, and its hash), and the comparison with a
live policy that already equals the render (the steady state: no write). ``parse`` is a first
parse of the base; ``parse (cached)`` is what a reconcile pays while the base ConfigMap's
resourceVersion is unchanged.

``python -m benchmarks.policy --json _artifacts/bench-policy.json``
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

from hack.crds import load_samples
from tailnet_operator.api.egress import TailnetEgress
from tailnet_operator.api.site import TailnetSite
from tailnet_operator.policy import diff_needed, parse_hujson, render
from tailnet_operator.policy.adapters import derive_from_objects
from tailnet_operator.policy.cache import ParsedPolicies
from tailnet_operator.policy.patch import Layout

from .record import conditions, write_section

BEGIN, END = "<!-- bench:policy:begin -->", "<!-- bench:policy:end -->"


def base_policy(rules: int) -> str:
    """A HuJSON base of ``rules`` rules (half grants, half acls), with comments on every rule."""
    teams, services = max(1, rules // 40), max(1, rules // 10)
    lines = ["// The tailnet policy of example.internal, kept by the platform team.", "{",
             "  // Who is in which team.", '  "groups": {']
    lines += [f'    "group:team-{t}": ["alice{t}@example.internal", "bob{t}@example.internal"],' for t in range(teams)]
    lines += ["  },", "  // Services and who may tag them.", '  "tagOwners": {']
    lines += [f'    "tag:svc-{s}": ["group:team-{s % teams}"],' for s in range(services)]
    lines += ["  },", '  "hosts": {']
    lines += [f'    "db-{s}": "10.{40 + s // 65536}.{s // 256 % 256}.{s % 256}",' for s in range(services)]
    lines += ["  },", "  // The rules: grants first, then the older acls.", '  "grants": [']
    for r in range(rules // 2):
        lines += [f"    // rule {r}: team {r % teams} reaches service {r % services} over https and ssh",
                  f'    {{"src": ["group:team-{r % teams}"], "dst": ["tag:svc-{r % services}"], '
                  f'"ip": ["tcp:443", "tcp:22", "tcp:{8000 + r % 1000}"]}},']
    lines += ["  ],", '  "acls": [']
    for r in range(rules - rules // 2):
        lines += [f"    /* acl {r}: the database of service {r % services} for team {r % teams} */",
                  f'    {{"action": "accept", "src": ["group:team-{r % teams}"], '
                  f'"dst": ["db-{r % services}:5432", "db-{r % services}:6432"]}},']
    lines += ["  ],", "}", ""]
    return "\n".join(lines)


def egresses(count: int) -> list[TailnetEgress]:
    sample = next(s for s in load_samples() if s["kind"] == "TailnetEgress")
    out = []
    for i in range(count):
        obj = copy.deepcopy(sample)
        obj["metadata"] = {"name": f"e{i:04d}", "namespace": "tailnet-system", "resourceVersion": str(i + 1)}
        obj["spec"]["tag"] = f"tag:egress-e{i:04d}"
        obj["spec"]["targets"][0]["address"] = f"192.168.{i // 256 % 256}.{i % 256}"
        out.append(TailnetEgress.model_validate(obj))
    return out


def sites(count: int) -> list[TailnetSite]:
    sample = next(s for s in load_samples() if s["kind"] == "TailnetSite")
    out = []
    for i in range(count):
        obj = copy.deepcopy(sample)
        obj["metadata"] = {"name": f"s{i:04d}", "resourceVersion": str(i + 1)}
        obj["spec"]["routes"] = [f"172.{16 + i // 256}.{i % 256}.0/24"]
        obj["spec"]["routerTag"] = f"tag:site-s{i:04d}"
        out.append(TailnetSite.model_validate(obj))
    return out


def timed(func: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median CPU time of ``func`` in ms (process time: the machine is shared, so wall time
    measures the neighbours too; the pipeline is single-threaded), and its result."""
    samples, result = [], None
    for _ in range(repeat):
        start = time.process_time()
        result = func()
        samples.append(time.process_time() - start)
    return median(samples) * 1000, result


def measure(rules: int, n_egresses: int, n_sites: int, repeat: int) -> dict[str, Any]:
    text = base_policy(rules)
    egress_objs, site_objs = egresses(n_egresses), sites(n_sites)
    parse_ms, base = timed(lambda: parse_hujson(text, source="base"), repeat)
    # What the Policy reconciler keeps between reconciles: the parsed base (by its ConfigMap's
    # resourceVersion) with its memo (the layout of its text), and the document of the last
    # render it wrote.
    cache = ParsedPolicies()
    base = cache.parse(text, source="base", version="1")
    memo_ms, _ = timed(lambda: Layout(text), repeat)
    memo = cache.memo(base)
    cached_ms, _ = timed(lambda: cache.parse(text, source="base", version="1"), repeat)
    derive_ms, derived = timed(lambda: derive_from_objects(egresses=egress_objs, sites=site_objs), repeat)
    render_cold_ms, _ = timed(lambda: render(base, derived, text=text), repeat)
    render_ms, rendered = timed(lambda: render(base, derived, memo=memo, text=text), repeat)
    canonical_ms, canonical = timed(lambda: render(base, derived, memo=memo), repeat)
    assert rendered.text == render(base, derived, text=text).text
    assert parse_hujson(rendered.text) == canonical.document, "the patched text is the canonical render's document"
    # One CR changed: the live policy is the previous render, which lacks that CR's grant.
    previous = render(base, derive_from_objects(egresses=egress_objs[1:], sites=site_objs), memo=memo, text=text)
    diff_cold_ms, needed = timed(lambda: diff_needed(previous.text, rendered), repeat)
    assert needed, "a live policy without the changed CR's grant needs a write"
    cache.remember(previous.text, previous.document, source="live")
    diff_ms, needed = timed(lambda: diff_needed(cache.parse(previous.text, source="live"), rendered), repeat)
    assert needed
    same_ms, same = timed(lambda: diff_needed(rendered.text, rendered), repeat)
    assert not same, "a live policy equal to the render needs no write"
    return {
        "base_bytes": len(text.encode()), "rendered_bytes": len(rendered.text.encode()),
        "added_grants": len(rendered.added.grants), "parse_ms": parse_ms, "memo_ms": memo_ms,
        "parse_cached_ms": cached_ms, "derive_ms": derive_ms, "render_cold_ms": render_cold_ms,
        "render_ms": render_ms, "render_canonical_ms": canonical_ms,
        "diff_cold_ms": diff_cold_ms, "diff_ms": diff_ms, "diff_same_ms": same_ms,
        "pipeline_first_ms": parse_ms + memo_ms + derive_ms + render_ms + diff_cold_ms,
        "pipeline_steady_ms": cached_ms + derive_ms + render_ms + diff_ms,
    }


def report(result: dict[str, Any], *, rules: int, n_egresses: int, n_sites: int, repeat: int,
           conditions: str) -> str:
    r = result
    return "\n".join([
        f"## The policy pipeline, {dt.date.today().isoformat()}", "",
        f"Machine: {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}. "
        f"{conditions} A base of {rules:,} rules "
        f"({r['base_bytes'] / 1024:.0f} KB of HuJSON with comments), {n_egresses:,} TailnetEgresses and "
        f"{n_sites:,} TailnetSites; the render is {r['rendered_bytes'] / 1024:.0f} KB with "
        f"{r['added_grants']:,} grants added. Medians of {repeat} runs, CPU ms of the (single-threaded) "
        "pipeline: process time, since wall time on the shared machine also counts the neighbours' work.", "",
        "| step | ms |", "|---|---|",
        f"| parse the base, first time (fast path: comments and trailing commas dropped, C JSON parser) "
        f"| {r['parse_ms']:.1f} |",
        f"| read the layout of the base's text (once per base version) | {r['memo_ms']:.1f} |",
        f"| parse the base, ConfigMap resourceVersion unchanged | {r['parse_cached_ms']:.3f} |",
        f"| derive | {r['derive_ms']:.1f} |",
        f"| render without the base's layout remembered | {r['render_cold_ms']:.1f} |",
        f"| render (the base's text with the entries inserted, and its hash) | {r['render_ms']:.1f} |",
        f"| for comparison: render as canonical JSON (comments lost; the render until 2026-11-30) "
        f"| {r['render_canonical_ms']:.1f} |",
        f"| diff with a live policy that must be parsed | {r['diff_cold_ms']:.1f} |",
        f"| diff with the live policy = the previous render (its document remembered) | {r['diff_ms']:.1f} |",
        f"| diff with the live policy = this render | {r['diff_same_ms']:.2f} |",
        f"| **whole pipeline, first reconcile** | **{r['pipeline_first_ms']:.1f}** |",
        f"| **whole pipeline, a CR changed** | **{r['pipeline_steady_ms']:.1f}** |", ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rules", type=int, default=2000)
    parser.add_argument("--egresses", type=int, default=1000)
    parser.add_argument("--sites", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--doc", type=Path, default=None)
    args = parser.parse_args(argv)
    before = os.getloadavg()
    result = measure(args.rules, args.egresses, args.sites, args.repeat)
    text = report(result, rules=args.rules, n_egresses=args.egresses, n_sites=args.sites, repeat=args.repeat,
                  conditions=conditions(before))
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.doc:
        write_section(args.doc, BEGIN, END, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
