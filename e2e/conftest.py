"""Fixtures that start the real components on 127.0.0.1.

* ``environment`` (session): owns the run directory and every process; its ``logs/`` folder
  is named in the report of any failing test.
* ``control_plane`` (session): etcd + kube-apiserver + kube-controller-manager.
* ``crds`` (session): the control plane with the project's CRDs installed.
* ``headscale`` (per test, fresh database) and ``module_headscale`` (per module).
* ``tailscale_nodes`` (per test): a factory of tailscaled nodes, stopped after the test.
* ``site_host`` (per test): a factory of hosts in network namespaces.
* ``module_tailscale_nodes``, ``module_site_host`` (per module): the same factories for a
  module's shared setup.
* ``cluster`` (session): a cluster that runs pods: the local node (root only), or the cluster
  in ``$TAILNET_E2E_KUBECONFIG`` (kind, under ``make e2e``); ``project_image`` (session): the
  project's image, built (cached by content) and loaded into it; ``cluster_headscale``
  (session): a Headscale that pods reach; ``installed_operator`` (session): the operator
  installed in it with ``kubectl apply -k``, Available.

After the session, any process of this run that is still alive fails the run and is killed, and
so does anything the local node left on the host (containers, mounts, links, routes, nftables
tables, cgroups, host paths, changed sysctls).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from e2e import skips
from hack import binaries
from hack.localenv import (
    Cluster,
    ControlPlane,
    Environment,
    Headscale,
    ManagedProcess,
    SiteHost,
    TailscaleNode,
    marked_processes,
    netns_available,
    wait_until,
)
from hack.suite import QUIET_AFTER
from tailnet_operator.runtime import config as rest_config
from tailnet_operator.runtime.client import Client

if TYPE_CHECKING:
    from e2e.certmanager_plane import CertManagerPlane
    from e2e.cluster import ClusterUnderTest, Image

_ARTIFACTS = Path(__file__).resolve().parent.parent / "_artifacts" / "test-runs"
_environment: Environment | None = None
_cluster: Cluster | None = None


def _session_environment() -> Environment:
    global _environment
    if _environment is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = _ARTIFACTS / f"{stamp}-{os.getpid()}"
        _environment = Environment(root, run_id=f"pytest-{stamp}-{os.getpid()}")
    return _environment


@pytest.fixture(scope="session")
def environment() -> Iterator[Environment]:
    env = _session_environment()
    try:
        yield env
    finally:
        env.close()


@pytest.fixture(scope="session")
def control_plane(environment: Environment) -> ControlPlane:
    return environment.control_plane()


@pytest.fixture(scope="session")
def crds(control_plane: ControlPlane) -> ControlPlane:
    """The control plane with the project's CRDs installed and Established."""
    from hack.crds import install_crds

    install_crds(control_plane.api_client())
    return control_plane


@pytest.fixture
async def admin(crds: ControlPlane) -> AsyncIterator[Client]:
    """An admin client of the control plane, with the project's CRDs installed."""
    async with Client(rest_config.load(crds.kubeconfig), field_manager="test-admin") as client:
        yield client


@pytest.fixture
async def operator_namespace(admin: Client) -> AsyncIterator[str]:
    """The operator's namespace for one test. Its Tailnets (``<namespace>-...`` or with their
    bootstrap Secret here) and their TailnetSites are removed with it."""
    from e2e.operator import remove_tailnets, unique
    from tailnet_operator.controllers.kinds import TAILNET_SITE
    from tailnet_operator.runtime.kinds import NAMESPACE

    name = unique("op")
    await admin.create(NAMESPACE, {"metadata": {"name": name}})
    yield name
    for site in (await admin.list(TAILNET_SITE)).items:
        if site["spec"]["tailnetRef"]["name"].startswith(f"{name}-"):
            await admin.delete(TAILNET_SITE, site["metadata"]["name"])
    await remove_tailnets(admin, name)
    await admin.delete(NAMESPACE, name)


@pytest.fixture
def headscale(environment: Environment) -> Iterator[Headscale]:
    server = environment.headscale()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cert_manager_plane(environment: Environment) -> Iterator[CertManagerPlane]:
    """A control plane of the module's own with cert-manager running against it
    (:mod:`e2e.certmanager_plane`)."""
    from e2e.certmanager_plane import plane_with_cert_manager

    with plane_with_cert_manager(environment) as plane:
        yield plane


@pytest.fixture(scope="module")
def module_headscale(environment: Environment) -> Iterator[Headscale]:
    server = environment.headscale()
    try:
        yield server
    finally:
        server.stop()


TailscaleFactory = Callable[..., TailscaleNode]


@contextlib.contextmanager
def _tailscale_factory(environment: Environment) -> Iterator[TailscaleFactory]:
    started: list[TailscaleNode] = []

    def start(hostname: str, headscale: Headscale, *, authkey: str | None = None,
              advertise_routes: Sequence[str] = (), accept_routes: bool = False,
              site_router: bool = False, host: SiteHost | None = None) -> TailscaleNode:
        node = environment.tailscale_node(hostname, headscale, authkey=authkey,
                                          advertise_routes=advertise_routes, accept_routes=accept_routes,
                                          site_router=site_router, host=host)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            node.stop()


@pytest.fixture
def tailscale_nodes(environment: Environment) -> Iterator[TailscaleFactory]:
    """``tailscale_nodes(hostname, headscale, authkey=..., advertise_routes=[...], accept_routes=...,
    site_router=...)``; a site router is the only node that can reach ``site_host`` LANs directly."""
    with _tailscale_factory(environment) as start:
        yield start


@pytest.fixture(scope="module")
def module_tailscale_nodes(environment: Environment) -> Iterator[TailscaleFactory]:
    """``tailscale_nodes`` for a module's shared setup: the nodes live until the module ends."""
    with _tailscale_factory(environment) as start:
        yield start


@contextlib.contextmanager
def _site_factory(environment: Environment) -> Iterator[Callable[[], SiteHost]]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    made: list[SiteHost] = []

    def create() -> SiteHost:
        host = environment.site_host()
        made.append(host)
        return host

    try:
        yield create
    finally:
        for host in made:
            host.destroy()


@pytest.fixture
def site_host(environment: Environment) -> Iterator[Callable[[], SiteHost]]:
    """A factory of hosts in network namespaces; needs root and iproute2."""
    with _site_factory(environment) as create:
        yield create


@pytest.fixture(scope="module")
def module_site_host(environment: Environment) -> Iterator[Callable[[], SiteHost]]:
    """``site_host`` for a module's shared setup: the hosts live until the module ends."""
    with _site_factory(environment) as create:
        yield create


def require_local_node() -> None:
    """Skip where the local node cannot run (a machine limitation: root, the node's tools)."""
    from hack.localenv.hostnet import HostNetwork

    reason = HostNetwork.available()
    if reason is not None:
        pytest.skip(f"the local node cannot run here: {reason}")


@pytest.fixture(scope="session")
def cluster(environment: Environment) -> ClusterUnderTest:
    """The cluster the ``cluster`` tests run against; started once per session."""
    from e2e.cluster import EXTERNAL_KUBECONFIG, KindCluster

    global _cluster
    if os.environ.get(EXTERNAL_KUBECONFIG):
        return KindCluster.from_environment()
    require_local_node()
    _cluster = environment.cluster()
    return _cluster


@pytest.fixture(scope="session")
def project_image(cluster: ClusterUnderTest) -> Image:
    """The project's image (Containerfile), built unless cached, loaded into the cluster."""
    from hack import image

    built = image.project_image()
    cluster.load_image(built)
    return built


@pytest.fixture(scope="session")
def cluster_headscale(environment: Environment, cluster: ClusterUnderTest) -> Iterator[Headscale]:
    """A Headscale that pods reach: it listens on the cluster's host address."""
    server = environment.headscale("cluster-headscale", address=cluster.host_address)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def installed_operator(cluster: ClusterUnderTest, project_image: Image,
                       tmp_path_factory: pytest.TempPathFactory) -> str:
    """The operator installed in the cluster with ``kubectl apply -k`` (the project's image) and
    Available; its namespace. Installed once per session, left in place for the cluster's teardown."""
    from e2e.cluster import install_operator_in_cluster

    return install_operator_in_cluster(cluster, project_image.ref, tmp_path_factory.mktemp("install"))


# -- the order of the tests and the binaries they wait for --------------------------------------

_HEADSCALE_ONLY = frozenset({"headscale", "module_headscale", "tailscale_nodes", "module_tailscale_nodes",
                             "site_host", "module_site_host"})
_CONTROL_PLANE = frozenset({"control_plane", "crds", "admin", "operator_namespace"})


def binaries_tier(fixtures: Iterable[str]) -> int | None:
    """How much a test needs built, from the fixtures it uses: 1 Headscale and tailscaled, 2 the
    control plane too, 3 the local node; None when no fixture says."""
    names = set(fixtures)
    if "cluster" in names:
        return 3
    if names & _CONTROL_PLANE:
        return 2
    return 1 if names & _HEADSCALE_ONLY else None


def module_tiers(items: Iterable[tuple[Path, Iterable[str]]]) -> dict[Path, int]:
    """Each module's tier: the highest of its tests'; 3 for a module none of whose tests uses a
    fixture that says (it starts its own binaries: chaos, cyclonus, CoreDNS)."""
    tiers: dict[Path, int | None] = {}
    for path, fixtures in items:
        tier = binaries_tier(fixtures)
        known = tiers.get(path)
        tiers[path] = tier if known is None else max(known, tier or 0)
    return {path: 3 if tier is None else tier for path, tier in tiers.items()}


def run_order(tier: int, *, before_cluster: bool, quiet: bool = False) -> tuple[int, int]:
    """Where a test runs: by its module's tier, and within a tier a module marked
    ``before_cluster`` first and one marked ``quiet`` last. A ``before_cluster`` module takes the
    host's local-node lock itself, which the session's cluster, once started, holds until the
    session ends; a ``quiet`` one waits for the machine to quieten (``_quiet_machine``)."""
    return tier, 0 if before_cluster else 2 if quiet else 1


TIER_PARTS = {"local": frozenset({0, 1, 2}), "node": frozenset({3})}
"""The parts ``--tiers`` (``e2e/parts.py``) selects. Only the node part touches the host's network
beyond its own namespaces and ports, so the two can run at once on one machine."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the part ``--tiers`` names; run the unit tests first, then the modules that need
    fewer binaries.

    ``make test`` builds the binaries in the background, in the order the tiers need them
    (``hack/binaries.py``, the ``test`` set), so the first tests run while the rest build. A
    module keeps its tests together and in their order (its fixtures are set up once).
    """
    e2e = Path(__file__).parent
    tiers = module_tiers((item.path, getattr(item, "fixturenames", ())) for item in items
                         if item.path.is_relative_to(e2e))
    part = config.getoption("--tiers")
    if part is not None:
        keep = TIER_PARTS[part]
        deselected = [item for item in items if tiers.get(item.path, 0) not in keep]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if tiers.get(item.path, 0) in keep]
    _prebuild_project_image(config, items)
    items.sort(key=lambda item: run_order(tiers.get(item.path, 0),
                                          before_cluster=item.get_closest_marker("before_cluster") is not None,
                                          quiet=item.get_closest_marker("quiet") is not None))


_prebuild: subprocess.Popen[bytes] | None = None


def _prebuild_project_image(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the project's image build now when a collected test will need it: it needs no Go
    binary, so it runs while the first tiers do and the binaries build, instead of on the
    cluster tier's critical path (``project_image`` then finds it cached, or waits for it)."""
    global _prebuild
    if config.option.collectonly or os.geteuid() != 0:
        return
    if not any("project_image" in getattr(item, "fixturenames", ()) for item in items):
        return
    from hack import image

    _prebuild = image.build_in_background(_session_environment().log_dir / "image-build.log", "project")


@contextlib.contextmanager
def _timeout_paused() -> Iterator[None]:
    """Pause the running test's timeout while it waits for a binary to be built.

    pytest-timeout arms ``ITIMER_REAL`` for each test (its ``signal`` method); a component built
    when a test first needs it is the build's time, not the test's.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    delay, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, delay, interval)


binaries.set_wait_hook(_timeout_paused)


QUIET_WAIT_S = 3600.0


@pytest.fixture(autouse=True, scope="module")
def _quiet_machine(request: pytest.FixtureRequest) -> None:
    """A module marked ``quiet`` sets up and starts once the suite's other part has ended (``hack/suite.py``
    names the file that says so); run on its own, it starts at once."""
    ended = os.environ.get(QUIET_AFTER)
    if ended is None or request.node.get_closest_marker("quiet") is None or Path(ended).exists():
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\nquiet: {request.node.nodeid} waits for the suite's local part to end")
    with _timeout_paused():
        wait_until(lambda: Path(ended).exists(), timeout=QUIET_WAIT_S, interval=1.0,
                   what="the suite's local part to end")


# -- reporting and the leak check ---------------------------------------------------------------

_failed = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    global _failed
    if report.failed and _environment is not None:
        _failed = True
        report.sections.append(("component logs", f"logs of every component: {_environment.log_dir}"))
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        skips.account(session, reporter, os.environ)
    if _prebuild is not None:
        from hack import image

        image.stop_background(_prebuild)
    if _environment is None:
        return
    _environment.close()
    survivors = list(marked_processes(_environment.run_id))
    leftovers = _cluster.leftovers() if _cluster is not None else []
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if survivors:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        lines = "\n".join(f"  pid {pid}: {cmd}" for pid, cmd in survivors)
        if reporter is not None:
            reporter.write_line(f"LEAK: processes started by the tests outlived them:\n{lines}", red=True)
    elif reporter is not None:
        reporter.write_line(f"leak check: no process of run {_environment.run_id} is left running")
    if leftovers:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line("LEAK: the local node left on the host:\n  " + "\n  ".join(leftovers), red=True)
    elif _cluster is not None and reporter is not None:
        timings = ", ".join(f"{k} {v:.1f}s" for k, v in _cluster.timings.items())
        reporter.write_line(f"leak check: the local node left nothing on the host (start: {timings})")
    if _failed or survivors or leftovers or exitstatus != 0:
        if reporter is not None:
            reporter.write_line(f"component logs kept in {_environment.log_dir}")
    else:
        shutil.rmtree(_environment.root, ignore_errors=True)


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    """Processes a test starts (append them); stopped at its end, the last started first."""
    started: list[ManagedProcess] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.stop()
