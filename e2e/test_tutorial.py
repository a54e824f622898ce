"""docs/tutorial/first-egress.md run as written, so that the page cannot drift from the product.

The test reads the page's fenced blocks and runs its ``bash`` blocks in order, from the top of the
repository, in one shell state (a variable one block sets, the later ones see), against the
cluster under test (the local node, or kind under ``make e2e``), the session's Headscale that pods
reach, a tailscaled subnet router of its own and a "database" (a TCP echo server) on a site host in
a network namespace. The HTML comment before each fence says what the test does with the block
(the page documents the convention in a comment at its top):

* ``tutorial-test: run``: as written; ``run-until-ok N``: again until it exits 0, for N seconds;
* ``tutorial-test: output``: a ``text`` block whose lines the run block before it must print;
* ``tutorial-test: stand-in NAME``: a step the test does its own way (:data:`STAND_INS`).

The only substitutions, all here: the page's database address and network become the site host's
(:func:`substitutions`), the settings block's variables the test's Headscale (:func:`settings`),
and ``KUBECONFIG`` and ``PATH`` point at the cluster and the pinned ``kubectl``, ``helm`` and the
``kubectl-tailnet`` plugin (:func:`shell_environment`).

The page installs the chart as the release ``tailnet-operator`` in ``tailnet-system``, where the
session's ``kubectl apply -k`` install lives when another module used it first: that install is
taken out before the page runs and put back afterwards (:func:`page_cleared`), as the page's
reader starts from a cluster without the operator.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from e2e.cluster import (
    EGRESSES,
    SITES,
    TAILNETS,
    ClusterUnderTest,
    Image,
    KindCluster,
    install_operator_in_cluster,
    kubectl,
    operator_logs,
)
from e2e.conftest import TailscaleFactory
from hack import binaries
from hack.image import PROJECT_REPOSITORY
from hack.localenv import Headscale, SiteHost, wait_until
from hack.localenv.install import OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE, REPO

PAGE = REPO / "docs" / "tutorial" / "first-egress.md"
PAGE_DATABASE = "198.18.50.10"
PAGE_NETWORK = "198.18.50.0/24"
"""The page's database and its network: inside 198.18.0.0/15, so the page run as written is safe."""
DATABASE_PORT = 5432
ROUTER_TAG = "tag:site-branch1"
SETTINGS = frozenset({"HEADSCALE_URL", "HEADSCALE_CA", "HEADSCALE_API_KEY"})
STAND_INS = frozenset({"settings", "load", "router"})
RELEASE = "tailnet-operator"
"""The page's Helm release (in :data:`OPERATOR_NAMESPACE`, as the page installs it)."""
CHART_NAMESPACES = (OPERATOR_NAMESPACE, "tailnet-gateway")
"""The namespaces the page's install makes (the chart renders the gateway's); the static install too."""
BLOCK_TIMEOUT = 600.0
PAGE_OBJECTS = ((("-n", OPERATOR_NAMESPACE), EGRESSES, "branch1"), ((), SITES, "branch1"), ((), TAILNETS, "headscale"))
"""The custom resources the page makes (namespace arguments, kind, name), in the order it deletes them."""
MARKER = re.compile(r"^<!-- tutorial-test: (.+?) -->$")
FENCE = re.compile(r"^```(\w*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of the page: its first line's number, language, marker (or "") and text."""

    line: int
    lang: str
    marker: str
    text: str

    @property
    def action(self) -> str:
        return self.marker.split()[0] if self.marker else ""

    @property
    def argument(self) -> str:
        return self.marker.split(maxsplit=1)[1] if " " in self.marker else ""


def page_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` in order, each with the marker on the last non-blank line
    before its opening fence."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = lines.index("```", index + 1)
        before = [line for line in lines[:index] if line.strip()]
        found = MARKER.match(before[-1]) if before else None
        blocks.append(Block(index + 1, opening.group(1), found.group(1) if found else "",
                            "\n".join(lines[index + 1:end]) + "\n"))
        index = end + 1
    return blocks


def marker_problems(blocks: list[Block]) -> list[str]:
    """What is wrong with the page's markers: a shell block without one, an unknown action or
    stand-in, an output block that follows no run block."""
    problems = []
    for number, block in enumerate(blocks):
        where = f"{PAGE.name}:{block.line}"
        if block.lang in ("bash", "sh") and block.action not in ("run", "run-until-ok", "stand-in"):
            problems.append(f"{where}: a {block.lang} block without a tutorial-test marker ({block.marker!r})")
        if block.action == "stand-in" and block.argument not in STAND_INS:
            problems.append(f"{where}: no stand-in {block.argument!r} (known: {sorted(STAND_INS)})")
        if block.action == "run-until-ok" and not block.argument.isdigit():
            problems.append(f"{where}: run-until-ok needs its seconds, not {block.argument!r}")
        if block.action == "output" and (number == 0 or not blocks[number - 1].action.startswith("run")):
            problems.append(f"{where}: an output block must follow a run block")
    return problems


def substitutions(host: SiteHost) -> Callable[[str], str]:
    """The page's addresses replaced by the site host's: the one substitution in the page's text."""
    table = {PAGE_NETWORK: host.subnet, PAGE_DATABASE: host.address}
    pattern = re.compile(r"(?<![\d.])(" + "|".join(re.escape(k) for k in table) + r")(?![\d/])")
    return lambda text: pattern.sub(lambda m: table[m.group(1)], text)


def shell_environment(cluster: ClusterUnderTest) -> dict[str, str]:
    """This process's environment with the cluster's kubeconfig and the page's tools first on PATH:
    the pinned kubectl and helm, and the venv's ``kubectl-tailnet`` (the plugin the page runs)."""
    env = dict(os.environ)
    env.pop("TAILNET_KUBECONFIG", None)
    tools = [str(binaries.binary(name).parent) for name in ("kubectl", "helm")]
    env["PATH"] = ":".join([*tools, str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    env["KUBECONFIG"] = str(cluster.kubeconfig)
    return env


@dataclass
class PageShell:
    """Runs the page's blocks with bash, carrying the variables a block sets to the later ones."""

    env: dict[str, str]
    substitute: Callable[[str], str]
    variables: dict[str, str] = field(default_factory=dict)
    transcript: list[str] = field(default_factory=list)

    def run(self, block: Block, extra_env: Mapping[str, str] | None = None) -> str:
        """Run ``block`` once; its stdout, or AssertionError with what it printed."""
        code, out, err = self._bash(self.substitute(block.text), extra_env or {})
        if code != 0:
            raise AssertionError(f"{PAGE.name}:{block.line}: the block exited {code}:\n{self.substitute(block.text)}"
                                 f"\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}")
        return out

    def run_until_ok(self, block: Block, seconds: float) -> str:
        """Run ``block`` until it exits 0, for up to ``seconds``; the last failure if it never does."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                return self.run(block)
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(3)

    def _bash(self, script: str, extra_env: Mapping[str, str]) -> tuple[int, str, str]:
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp) / "env"
            wrapped = f"set -a -euo pipefail\n{script}\nenv -0 > {state}\n"
            env = {**self.env, **self.variables, **extra_env}
            code, out, err = _run_group(["bash", "-c", wrapped], env, BLOCK_TIMEOUT)
            self.transcript.append(f"$ {script.strip()}\n{out}{err}".rstrip())
            if code == 0:
                self.variables.update(_new_variables(state.read_text(), env))
        return code, out, err


def _run_group(argv: list[str], env: Mapping[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``argv`` in its own process group, killed whole at ``timeout`` (kubectl exec, helm's hooks)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -1, out, err + f"\n(killed after {timeout:.0f}s)"
    return proc.returncode, out, err


def _new_variables(dump: str, before: Mapping[str, str]) -> dict[str, str]:
    """The variables a block set (``set -a`` exports them): what ``env -0`` shows beyond ``before``."""
    shell_own = {"PWD", "OLDPWD", "SHLVL", "_"}
    pairs = (entry.split("=", 1) for entry in dump.split("\0") if "=" in entry)
    return {k: v for k, v in pairs if k not in shell_own and before.get(k) != v}


def assigned_names(text: str) -> set[str]:
    """The variables a block assigns at the start of a line (``NAME=...``)."""
    return set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", text, flags=re.MULTILINE))


def expected_lines(block: Block) -> list[str]:
    """The lines an output block promises, without its ``...`` elisions."""
    return [line.strip() for line in block.text.splitlines() if line.strip() and line.strip() != "..."]


# -- the page's text, checked without a cluster --------------------------------------------------


def test_every_shell_block_of_the_page_says_what_the_test_does_with_it() -> None:
    blocks = page_blocks(PAGE.read_text())
    assert [b for b in blocks if b.action.startswith("run")], "the page has no block the test runs"
    assert marker_problems(blocks) == []
    stand_ins = {b.argument for b in blocks if b.action == "stand-in"}
    assert stand_ins == STAND_INS, f"stand-ins the page uses: {stand_ins}; the test has: {sorted(STAND_INS)}"


def test_a_block_without_a_marker_or_with_an_unknown_one_is_a_problem() -> None:
    """The guard above can fail: a new shell block nobody marked, a stand-in the test does not know,
    an output block after prose."""
    page = ("<!-- tutorial-test: run -->\n```bash\ntrue\n```\n\n```bash\nuntested\n```\n\n"
            "<!-- tutorial-test: stand-in coffee -->\n```bash\nbrew\n```\n\n"
            "<!-- tutorial-test: output -->\n```text\nx\n```\n")
    problems = marker_problems(page_blocks(page))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "a bash block without a tutorial-test marker ('')",
        "no stand-in 'coffee' (known: ['load', 'router', 'settings'])",
        "an output block must follow a run block",
    ], problems


def test_the_page_names_only_addresses_no_network_routes() -> None:
    """Every IPv4 address or network in the page's blocks lies in 198.18.0.0/15, which the test's site
    hosts use and no network routes: a reader running the page as written sends nothing elsewhere."""
    benchmark = ipaddress.IPv4Network("198.18.0.0/15")
    text = "\n".join(b.text for b in page_blocks(PAGE.read_text()))
    found = re.findall(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?)(?![\w.])", text)
    assert PAGE_DATABASE in found and PAGE_NETWORK in found, found
    outside = [a for a in found if not ipaddress.IPv4Network(a, strict=False).subnet_of(benchmark)]
    assert outside == [], f"addresses outside {benchmark} in {PAGE.name}: {outside}"


# -- the page run against the cluster ------------------------------------------------------------


def _exists(cluster: ClusterUnderTest, *args: str) -> bool:
    return bool(kubectl(cluster, "get", *args, "--ignore-not-found", "-o", "name", check=False).strip())


def _static_install_present(cluster: ClusterUnderTest) -> bool:
    """The session's ``kubectl apply -k`` install is in the page's namespace (``helm template``
    output carries no release annotation, a Helm release's objects do)."""
    found = kubectl(cluster, "-n", OPERATOR_NAMESPACE, "get", "deployment", OPERATOR_DEPLOYMENT,
                    "--ignore-not-found", "-o", "json", check=False).strip()
    annotations = json.loads(found)["metadata"].get("annotations") or {} if found else {}
    return bool(found) and "meta.helm.sh/release-name" not in annotations


def _wait_namespaces_gone(cluster: ClusterUnderTest, names: tuple[str, ...], timeout: float = 300) -> None:
    try:
        wait_until(lambda: not any(_exists(cluster, "namespace", n) for n in names), timeout=timeout,
                   what=f"namespaces {', '.join(names)} deleted")
    except TimeoutError as exc:
        left = kubectl(cluster, "get", "namespace", *names, "-o", "yaml", check=False)
        raise AssertionError(f"{exc}:\n{left[-3000:]}") from exc


def _remove_static_install(cluster: ClusterUnderTest) -> None:
    """Take the session's ``kubectl apply -k`` install out of the page's way, leaving the CRDs: the
    custom resources in its namespace first, while it still runs to remove their finalizers."""
    for kind in (EGRESSES, "tailnetingresses.tailnet.dev"):
        kubectl(cluster, "-n", OPERATOR_NAMESPACE, "delete", kind, "--all", "--timeout=120s", check=False)
    kubectl(cluster, "delete", "-k", str(REPO / "manifests" / "install"), "--ignore-not-found", "--wait=false",
            timeout=180)
    _wait_namespaces_gone(cluster, CHART_NAMESPACES)


def _adopt_crds(cluster: ClusterUnderTest) -> None:
    """CRDs already in the cluster (the static install's, or another release's kept ones) handed to
    the page's release, as Helm documents for adopting objects: otherwise ``helm install`` refuses
    them. A cluster without them (the page's reader's) needs nothing."""
    names = kubectl(cluster, "get", "crd", "-o", "name", check=False).split()
    for crd in [n for n in names if n.endswith(".tailnet.dev")]:
        kubectl(cluster, "label", "--overwrite", crd, "app.kubernetes.io/managed-by=Helm")
        kubectl(cluster, "annotate", "--overwrite", crd, f"meta.helm.sh/release-name={RELEASE}",
                f"meta.helm.sh/release-namespace={OPERATOR_NAMESPACE}")


def _undo_page(cluster: ClusterUnderTest, env: Mapping[str, str]) -> None:
    """What the page's clean-up does, for a run that stopped before it: idempotent, and finalizers
    dropped where no operator is left to remove them."""
    kubectl(cluster, "delete", "namespace", "payments", "--ignore-not-found", "--wait=false", check=False)
    for scope, kind, name in PAGE_OBJECTS:
        kubectl(cluster, *scope, "delete", kind, name, "--ignore-not-found", "--timeout=60s", check=False)
    _run_group(["helm", "uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--ignore-not-found"], env, 180)
    for scope, kind, name in PAGE_OBJECTS:
        kubectl(cluster, *scope, "patch", kind, name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                check=False)
    kubectl(cluster, "delete", "namespace", *CHART_NAMESPACES, "--ignore-not-found", "--wait=false", check=False)
    _wait_namespaces_gone(cluster, (*CHART_NAMESPACES, "payments"))


@contextlib.contextmanager
def page_cleared(cluster: ClusterUnderTest, image: Image, env: Mapping[str, str], workdir: Path) -> Iterator[None]:
    """The cluster as the page's reader has it (no operator, the page's namespaces free) while the
    page runs; afterwards nothing of the page left, and the session's static install back if it
    was there."""
    restore = _static_install_present(cluster)
    if restore:
        _remove_static_install(cluster)
    taken = [n for n in (*CHART_NAMESPACES, "payments") if _exists(cluster, "namespace", n)]
    assert not taken, f"the page makes these namespaces, and they exist already: {taken}"
    _adopt_crds(cluster)
    try:
        yield
    finally:
        _undo_page(cluster, env)
        if restore:
            install_operator_in_cluster(cluster, image.ref, workdir / "static-install")


def diagnostics(cluster: ClusterUnderTest, shell: PageShell) -> str:
    """What the cluster held when the page failed: the objects, the pods, the operator's logs."""
    objects = kubectl(cluster, "get", f"{TAILNETS},{SITES}", "-o", "yaml", check=False)
    egress = kubectl(cluster, "-n", OPERATOR_NAMESPACE, "get", EGRESSES, "-o", "yaml", check=False)
    pods = kubectl(cluster, "get", "pods", "-A", "-o", "wide", check=False)
    agent = kubectl(cluster, "-n", OPERATOR_NAMESPACE, "logs", "-l", "tailnet.dev/egress=branch1", "--tail=40",
                    "--prefix", check=False)
    return "\n".join([f"transcript:\n{chr(10).join(shell.transcript)[-6000:]}", f"objects:\n{objects[-4000:]}",
                      f"egress:\n{egress[-4000:]}", f"pods:\n{pods[-3000:]}", f"agent logs:\n{agent}",
                      f"operator logs:\n{operator_logs(cluster, OPERATOR_NAMESPACE)}"])


@dataclass(frozen=True)
class PageImage:
    """The image the page built: what its build block read into ``IMAGE`` and ``ARCHIVE``."""

    ref: str
    archive: Path


@dataclass
class Stand:
    """What the stand-in steps need: the test's Headscale, its site host and a tailscaled factory."""

    cluster: ClusterUnderTest
    headscale: Headscale
    host: SiteHost
    nodes: TailscaleFactory

    def settings(self, shell: PageShell, block: Block) -> None:
        """The reader's three settings, as the test's Headscale has them."""
        assert assigned_names(block.text) == SETTINGS, f"the settings block sets {assigned_names(block.text)}"
        shell.variables.update(HEADSCALE_URL=self.headscale.url, HEADSCALE_CA=str(self.headscale.ca_bundle),
                               HEADSCALE_API_KEY=self.headscale.api_key)

    def load(self, shell: PageShell, block: Block) -> None:
        """On kind the block as written, with our dockerd and the cluster's name (kind's
        ``KIND_CLUSTER_NAME``); on the local node the page's archive imported as the node takes it."""
        if not isinstance(self.cluster, KindCluster):
            self.cluster.load_image(PageImage(shell.variables["IMAGE"], Path(shell.variables["ARCHIVE"])))
            return
        from hack.kind import docker

        env = docker.environment({"PATH": f"{binaries.binary('kind').parent}:{shell.env['PATH']}"})
        shell.run(block, {**env, "KIND_CLUSTER_NAME": self.cluster.name})

    def router(self, shell: PageShell, block: Block) -> None:
        """The branch's router: a tailscaled joined with a key tagged with the site's routerTag,
        advertising the site host's network, the only process that reaches that host."""
        text = shell.substitute(block.text)
        assert ROUTER_TAG in text and f"--advertise-routes={self.host.subnet}" in text, text
        self.nodes("branch1-router", self.headscale, authkey=self.headscale.create_preauth_key(tags=[ROUTER_TAG]),
                   advertise_routes=[self.host.subnet], site_router=True)


def run_page(shell: PageShell, stand: Stand, blocks: list[Block]) -> dict[int, str]:
    """Every block in order; what each run block printed, by its line."""
    printed: dict[int, str] = {}
    last = ""
    for block in blocks:
        if block.action == "run":
            last = printed[block.line] = shell.run(block)
        elif block.action == "run-until-ok":
            last = printed[block.line] = shell.run_until_ok(block, float(block.argument))
        elif block.action == "stand-in":
            getattr(stand, block.argument)(shell, block)
        elif block.action == "output":
            missing = [line for line in expected_lines(block) if shell.substitute(line) not in last]
            assert not missing, f"{PAGE.name}:{block.line}: not printed: {missing}\nprinted:\n{last}"
    return printed


@pytest.mark.integration
@pytest.mark.cluster
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_the_first_egress_tutorial_runs_as_written(
        cluster: ClusterUnderTest, project_image: Image, cluster_headscale: Headscale,
        site_host: Callable[[], SiteHost], tailscale_nodes: TailscaleFactory, tmp_path: Path) -> None:
    blocks = page_blocks(PAGE.read_text())
    assert marker_problems(blocks) == []
    host = site_host()
    host.serve_echo(DATABASE_PORT)
    shell = PageShell(shell_environment(cluster), substitutions(host))
    stand = Stand(cluster, cluster_headscale, host, tailscale_nodes)
    with page_cleared(cluster, project_image, shell.env, tmp_path):
        try:
            run_page(shell, stand, blocks)
        except (AssertionError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{diagnostics(cluster, shell)}") from exc
    # The page's build read the project's image (the fixture's unless the tree changed in between).
    assert shell.variables["IMAGE"].startswith(f"{PROJECT_REPOSITORY}:"), shell.variables["IMAGE"]
    print("\n\n".join(shell.transcript))
