"""How long a tailnet peer cannot resolve a MagicDNS name while Headscale moves it between two nodes.

An ingress's rollout ends with a hand-over (``controllers/ingress.py`` ``free_hostname``): its old
node is renamed away from ``spec.hostname``, then its new node is renamed to it. Headscale has no
swap, so between the two renames no node carries the name, and Headscale sends its peers each batch
interval's changes together (``tuning.batch_change_delay``, 800 ms by default). A peer whose map
update falls between the two renames cannot resolve the name until the next one.

Headscale also applies node writes in batches (``tuning.node_store_batch_timeout``, 500 ms, on a
ticker of its own): sent one after the other, the second rename waits for the batch after the first
one's. Sent together (``HeadscaleClient.rename_nodes``), both land in one batch unless one of
Headscale's ticks falls between their arrivals; the operator sends them right after a batch (a
rename that changes nothing is answered when its batch is applied), when the next tick is furthest.

This measures both ways on the real binaries, on loopback: two tailscaled nodes A and B (each
forwarding a tailnet port to a TCP server on 127.0.0.1 with ``tailscale serve --tcp``) and a
tailscaled laptop. The laptop's HTTP proxy is asked to CONNECT to ``svc.<base domain>:PORT`` every
:data:`INTERVAL` seconds (a 200 needs the name resolved and the node dialled). Each trial moves the
name from the node holding it to the other, ``one after the other`` (each rename awaited before
the next is sent), ``together`` (``rename_nodes``) or ``together, after a batch`` (as the operator
does), the ways taking turns, and counts the laptop's refused CONNECTs from the first rename until
the name answers again.

    python -m benchmarks.name_handover [--trials 15] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.ingress_serve import connects, process
from benchmarks.record import commit, load_average, publish
from hack import versions
from hack.https_client import tunnel
from hack.localenv import BASE_DOMAIN, Environment, Headscale, TailscaleNode, free_port, wait_until
from tailnet_operator.headscale import HeadscaleClient

NAME = "svc"
PORT = 7000
"""The tailnet port A and B forward to the TCP server."""
INTERVAL = 0.01
"""Seconds between the starts of two CONNECTs."""
ATTEMPT_TIMEOUT = 1.0
STEADY = 20
"""CONNECTs in a row that must succeed before a trial starts and after it ends."""


WAYS = ("one after the other", "together", "together, after a batch")
"""How a trial sends the two renames: each awaited before the next; together (``rename_nodes``);
together right after a batch of Headscale's (``rename_nodes(..., last_name=...)``, the operator's way)."""


@dataclass
class Trial:
    way: str
    """Of :data:`WAYS`."""
    holder: str
    """The node that held the name before the trial."""
    renames_s: float
    """From the first rename's request to the last answer."""
    resent: bool
    """The taking rename was refused (it reached Headscale before the freeing one) and sent again."""
    refused: int
    """CONNECTs that failed from the first rename on."""
    window_ms: float
    """From the start of the first failed CONNECT to the end of the last (0 when none failed)."""


class Renames:
    """Counts the rename requests the client sends (a :class:`RequestObserver`)."""

    def __init__(self) -> None:
        self.sent = 0

    def request_done(self, *, method: str, path: str, code: str, seconds: float) -> None:
        self.sent += "/rename/" in path


class Prober:
    """CONNECTs through the laptop's proxy every :data:`INTERVAL`; keeps (start, end, ok) of each."""

    def __init__(self, proxy_port: int) -> None:
        self.proxy_port = proxy_port
        self.samples: list[tuple[float, float, bool]] = []

    async def _one(self) -> bool:
        _, writer = await tunnel(self.proxy_port, f"{NAME}.{BASE_DOMAIN}", PORT)  # ConnectionError if refused
        writer.close()
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            try:
                ok = await asyncio.wait_for(self._one(), ATTEMPT_TIMEOUT)
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                ok = False
            self.samples.append((start, loop.time(), ok))
            await asyncio.sleep(max(0.0, start + INTERVAL - loop.time()))

    def streak(self) -> int:
        count = 0
        for *_, ok in reversed(self.samples):
            if not ok:
                break
            count += 1
        return count

    async def steady(self, timeout: float) -> None:
        mark = len(self.samples)
        deadline = asyncio.get_running_loop().time() + timeout
        while not (self.streak() >= STEADY and len(self.samples) - mark >= STEADY):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{STEADY} CONNECTs to {NAME} in a row did not succeed within {timeout:g}s")
            await asyncio.sleep(INTERVAL)


def window(samples: list[tuple[float, float, bool]], since: float) -> tuple[int, float]:
    """The failed samples that started at ``since`` or later, and the span (ms) they cover."""
    failed = [(start, end) for start, end, ok in samples if not ok and start >= since]
    if not failed:
        return 0, 0.0
    return len(failed), round((max(e for _, e in failed) - min(s for s, _ in failed)) * 1000, 1)


async def trial(client: HeadscaleClient, renames: Renames, laptop: TailscaleNode, prober: Prober,
                ids: dict[str, str], holder: str, way: str) -> Trial:
    other = next(n for n in ids if n != holder)
    freeing, taking = (ids[holder], f"{NAME}-old-{holder}"), (ids[other], NAME)
    await prober.steady(60)
    loop = asyncio.get_running_loop()
    started, sent_before = loop.time(), renames.sent
    if way == "together":
        await client.rename_nodes([freeing], taking)
    elif way == "together, after a batch":
        await client.rename_nodes([freeing], taking, last_name=f"{NAME}-old-{other}")
    else:
        await client.rename_node(*freeing)
        await client.rename_node(*taking)
    renamed = loop.time() - started

    def moved() -> bool:
        names = {p.get("HostName"): str(p.get("DNSName") or "").split(".")[0] for p in laptop.peers()}
        return names.get(f"handover-{other}") == NAME and names.get(f"handover-{holder}") == f"{NAME}-old-{holder}"

    await asyncio.to_thread(wait_until, moved, timeout=30, interval=0.1, what="the laptop's netmap with the new names")
    await prober.steady(60)
    refused, span = window(prober.samples, started)
    expected = 3 if way == "together, after a batch" else 2  # that way first sends a rename that changes nothing
    return Trial(way, holder, round(renamed, 4), renames.sent - sent_before > expected, refused, span)


async def trials(headscale: Headscale, laptop: TailscaleNode, ids: dict[str, str], count: int) -> list[Trial]:
    prober = Prober(laptop.http_proxy_port)
    results: list[Trial] = []
    holder = "a"
    renames = Renames()
    async with (HeadscaleClient(headscale.url, headscale.api_key, ca_bundle=headscale.ca_bundle,
                                observer=renames) as client,
                asyncio.TaskGroup() as group):
        probing = group.create_task(prober.run())
        try:
            for number in range(count):
                # Taking turns, so a slow phase of the machine hits all alike, and each way moving
                # the name from either node as often (WAYS has an odd length).
                for way in WAYS if number % 2 == 0 else WAYS[::-1]:
                    result = await trial(client, renames, laptop, prober, ids, holder, way)
                    results.append(result)
                    print(json.dumps({"trial": number + 1, **asdict(result)}), flush=True)
                    holder = "b" if holder == "a" else "a"
        finally:
            probing.cancel()
    return results


def rename(headscale: Headscale, node_id: str, name: str) -> None:
    headscale.api("POST", f"/api/v1/node/{node_id}/rename/{name}")


def run(count: int) -> dict[str, Any]:
    before = os.getloadavg()
    backend_port = free_port()
    with Environment() as env, contextlib.ExitStack() as stack:
        stack.enter_context(process([sys.executable, "-m", "benchmarks.paths", "serve", "127.0.0.1",
                                     str(backend_port)], env.log_dir / "handover-backend.log"))
        wait_until(lambda: connects(backend_port), timeout=30, what="the TCP server")
        headscale = env.headscale()
        key = headscale.create_preauth_key(tags=["tag:handover"], reusable=True)
        laptop = env.tailscale_node("handover-laptop", headscale, authkey=key)
        nodes = {n: env.tailscale_node(f"handover-{n}", headscale, authkey=key) for n in ("a", "b")}
        for node in nodes.values():
            node.cli("serve", "--bg", f"--tcp={PORT}", f"tcp://127.0.0.1:{backend_port}")
        listed = {n["name"]: str(n["id"]) for n in headscale.nodes()}
        ids = {n: listed[f"handover-{n}"] for n in nodes}
        rename(headscale, ids["b"], f"{NAME}-old-b")
        rename(headscale, ids["a"], NAME)
        results = asyncio.run(trials(headscale, laptop, ids, count))
    return {"trials": [asdict(t) for t in results], "ways": list(WAYS), "count": count,
            "loadavg": [list(before), list(os.getloadavg())], "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "commit": commit(), "headscale": versions.HEADSCALE, "tailscale": versions.TAILSCALE}


def section(doc: dict[str, Any]) -> str:
    rows = ["| renames sent | trials | with refused CONNECTs | refused (all trials) | "
            "window ms, median of those | window ms, longest | renames took ms, median | taking rename sent again |",
            "|---|---|---|---|---|---|---|---|"]
    for way in doc["ways"]:
        mine = [t for t in doc["trials"] if t["way"] == way]
        if not mine:
            continue
        hit = [t for t in mine if t["refused"]]
        windows = [round(t["window_ms"], 1) for t in hit]
        median, longest = (round(statistics.median(windows), 1), max(windows)) if windows else ("-", "-")
        rows.append(f"| {way} | {len(mine)} | {len(hit)} | {sum(t['refused'] for t in mine)} | {median} | {longest} | "
                    f"{statistics.median(t['renames_s'] for t in mine) * 1000:.1f} | "
                    f"{sum(1 for t in mine if t.get('resent'))} |")
    before, after = doc["loadavg"]
    return "\n".join([
        f"### The name hand-over, {doc['date']}, commit {doc['commit']} (Headscale {doc['headscale']}, "
        f"tailscaled {doc['tailscale']})",
        "",
        "Two tailscaled nodes and a tailscaled laptop on 127.0.0.1, Headscale's default batch intervals "
        f"(node writes 500 ms, map updates 800 ms). The laptop CONNECTs to `{NAME}.{BASE_DOMAIN}` every "
        f"{INTERVAL * 1000:g} ms through its HTTP proxy; each trial renames the node holding `{NAME}` away "
        "and the other node to it, the two renames sent one after the other, together, or together right "
        f"after a batch of Headscale's (the operator's way), {doc['count']} trials each, taking turns. "
        f"{load_average(before, after)}.",
        "",
        *rows,
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=15, help="trials per way of sending the renames (default 15)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--doc", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args(argv)
    doc = run(args.trials)
    publish(section(doc), doc, json_path=args.json, doc_path=args.doc, name="name-handover")
    return 0


if __name__ == "__main__":
    sys.exit(main())
