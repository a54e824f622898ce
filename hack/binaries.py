"""Build and cache, by version, the real binaries the tests and the local environment run.

Every binary comes from Go modules through the Go toolchain:

* Headscale, Tailscale and etcd are built from a throwaway module that requires the exact
  version (etcd's server module replaces its siblings with relative paths, which rules out
  ``go install``; for the others it avoids the version-list lookup ``go install`` makes).
* The Kubernetes commands live in ``k8s.io/kubernetes``, whose go.mod points its staging
  modules at ``./staging``; a throwaway module replaces each of them with the published
  ``k8s.io/<name> v0.<minor>.<patch>`` and builds the commands from there.
* The local node's containerd (with its runc shim and ``ctr``), the CNI plugins, CoreDNS,
  kind, cyclonus, Helm and Prometheus (with ``promtool``) come the same way, with the build tags
  their own Makefiles use. Prometheus' web UI assets are not embedded (no ``builtinassets`` tag):
  the tests use its HTTP API only.
* cert-manager's controller command is a module of its own that the proxy does not serve; a
  throwaway module that requires ``github.com/cert-manager/cert-manager`` builds the project's
  small main (``hack/certmanager/main.go``) that runs the registered certificates and issuer
  controllers and the ingress-shim the way that command does (test-only: the tests issue
  certificates with it). Its cache directory carries a hash of that main, so a change to it builds anew.
* runc needs cgo for its ``nsenter`` part and libseccomp (the ``seccomp`` tag) for the
  ``RuntimeDefault`` profile that Pod Security's ``restricted`` level demands: it is built
  inside a copy of its own module, with cgo, against Debian's libseccomp-dev. Its
  go.mod replaces go-selinux with a patched copy that is a module of its own and so absent
  from the published module; the build drops that replace and uses the go-selinux release it
  names (the patch only matters on hosts that enforce SELinux labels, which this one does not).

Binaries land in ``<cache>/bin/<component>-<version>/``; a component whose binaries are all
present is not rebuilt, so a second run takes seconds.

Headscale and Tailscale also have ranges (``hack/versions.py``) for the interop matrix: any
listed version builds on demand (``build headscale@0.26.1``) into its own directory, and
``$TAILNET_HEADSCALE_VERSION`` / ``$TAILNET_TAILSCALE_VERSION`` make :func:`binary` (so every
fixture and ``make run``) use that version instead of the pin.

What each command builds, and how
---------------------------------

Each ``make`` command builds one named set (:data:`SETS`, ``build --set NAME``), the
components it starts, found from the ``binary(...)`` calls of what that command runs:

* ``run``: ``make run`` starts etcd, the Kubernetes commands and Headscale, and, where the
  local node can run (root, and ``$TAILNET_LOCALENV_NODE`` not ``0``), containerd with runc,
  the CNI plugins and CoreDNS (the cluster DNS image). The operator itself is Python.
* ``test``: ``make test`` adds what the suite starts: tailscaled, cyclonus (the NetworkPolicy
  oracle), Helm (the chart), Prometheus and promtool (monitoring), cert-manager and MetalLB.
  Without the node its pieces are left out, as for ``run`` (their tests are skipped).
* ``bench``: the node set (the in-cluster benchmark) plus tailscaled.
* ``interop`` and ``chaos``: the host tier only: etcd, Kubernetes, Headscale, tailscaled (the
  interop matrix then builds the versions of its cells itself).
* ``e2e``: kind and what the ``cluster`` tests start next to it (kubectl, Helm, the router and
  CoreDNS images, cert-manager, MetalLB, cyclonus, Headscale and tailscaled).
* ``all``: every pinned component (``build`` with no argument, ``make binaries``).

A component missing from a set is still built the moment something asks for it:
:func:`binary` builds what is not cached.

The build of a set is a two-stage pipeline:

1. One thread *prepares* components in turn: the throwaway module (or the module copy),
   ``go get``, and ``go list -deps`` of the packages to build, which downloads every module the
   compile needs without compiling anything. This runs ahead of the compiles, so downloads
   (network-bound) overlap the compiles (CPU-bound). Preparing takes no lock.
2. At most ``--jobs`` (default 2, 1 on a one-CPU machine) compiles run at once. A second
   compile starts only while ``MemAvailable`` (``/proc/meminfo``) is at least
   :data:`SECOND_BUILD_MIN_FREE` (6 GiB, room for two Kubernetes-sized compiles and links
   beside whatever else the machine runs); with less, it waits for the running one to end.
   One compile always runs, whatever the memory, so the pipeline never stalls. On 2 cores two
   ``go build`` processes mostly share the same CPUs; what the second one wins is the time the
   first spends in single-threaded links and in loading packages.

Components start longest first (from the durations of their last builds) so that the long
ones do not end up alone at the tail. The durations are kept in ``<cache>/bin/.timings.json``
(component-version -> seconds, when, how many compiles ran beside it); before any build is
recorded, :data:`TYPICAL_SECONDS` (cold, one at a time, on 2 cores) stands in. Each component
prints a progress line: what is being built, how long its last build took, and what is left.

A builder holds a component's per-version lock only while it compiles it: a component whose
lock another process holds (a second worktree, the interop matrix, CI's background build) is
passed over for the next prepared one and tried again every few seconds, then found cached.
A component prepared but waiting for a free slot stays free for another builder to take, so
two builders never wait on each other's queues (CI's one-at-a-time background build once kept
Headscale, which the first tests need, behind its Kubernetes). Every component ``go build``s in
the shared default Go caches (``GOCACHE``, ``GOMODCACHE``), so packages two components share
compile once.

Building less:

* Prometheus and promtool carry no service discovery (``remove_all_sd``): the tests scrape
  static targets, and the discovery plugins bring the cloud SDKs (AWS, Azure, GCE, ...) in.
* tailscaled and the CLI leave out the AWS parameter-store state store (``ts_omit_aws``, which
  every version of the range knows), and so the AWS SDK. The Kubernetes-secret state store
  stays: the gateway's router runs with ``--state=kube:<secret>``.
* CoreDNS is built inside a copy of its module with the plugins that need a cloud SDK or an
  outside service left out of ``core/plugin/zplugin.go`` (:data:`COREDNS_DROPPED_PLUGINS`);
  every plugin a Corefile of this project uses (kubernetes, hosts, file, cache, forward, ...)
  stays.
* Components of several commands build them in one ``go build -o DIR/`` when the binaries
  are named after their packages, so the links run beside the remaining compiles, and every
  package is compiled without DWARF (``-gcflags=all=-dwarf=false``; the links strip it anyway).

A build failure does not stop the others (the cache keeps what did build); every failure is
printed when it happens and again at the end, and the command exits 1.

Usage: ``python -m hack.binaries [build [--set NAME]... [--jobs N] [COMPONENT[@VERSION]...] |
path BINARY | list]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Generic, Protocol, TypeVar

from hack import versions


class MissingToolError(RuntimeError):
    """A prerequisite that the project cannot install by itself is absent."""


def cache_root() -> Path:
    """The per-user cache directory for everything this project builds."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tailnet-operator"


@dataclass(frozen=True)
class Component:
    """One versioned set of binaries built from one Go module."""

    name: str
    version: str
    binaries: tuple[str, ...]
    module: str = ""
    packages: tuple[str, ...] = ()
    """Import path of each binary, in the order of ``binaries``."""
    tags: str = ""
    in_module: bool = False
    """Build inside a copy of the module itself (its own go.mod and go.sum hold)."""
    cgo: bool = False
    drop_replaces: tuple[str, ...] = ()
    """``replace`` directives of that go.mod whose targets the published module lacks."""
    drop_plugins: tuple[str, ...] = ()
    """CoreDNS plugins whose imports are taken out of the copy's ``core/plugin/zplugin.go``."""
    x_version: str = ""
    """A Go variable that ``-ldflags -X`` sets to ``v<version>`` (what ``<binary> version`` prints)."""
    main: str = ""
    """A main package of this repository (a directory under hack/) built against the module."""
    replaces: tuple[str, ...] = ()
    """``old=new@version`` replacements in the throwaway module (a module whose own go.mod replaces
    a sibling by a relative path, which a dependent's build ignores)."""

    @property
    def directory(self) -> Path:
        return cache_root() / "bin" / self.key

    @property
    def key(self) -> str:
        """``name-version`` (``name-version-<hash>`` with a ``main`` of this repository, so that a
        change to it builds anew): the cache directory's name, the lock's and the timing record's key."""
        if not self.main:
            return f"{self.name}-{self.version}"
        return f"{self.name}-{self.version}-{_main_digest(self.main)}"

    def path(self, binary: str) -> Path:
        return self.directory / binary

    def is_built(self) -> bool:
        return all(self.path(b).is_file() for b in self.binaries)


@functools.cache
def _main_digest(main: str) -> str:
    """The first 12 hex digits of the SHA-256 of ``hack/<main>/main.go``, read once per process."""
    return hashlib.sha256((Path(__file__).parent / main / "main.go").read_bytes()).hexdigest()[:12]


_KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kubectl", "kube-scheduler", "kubelet",
                        "kube-proxy")
KUBERNETES = Component("kubernetes", versions.KUBERNETES, _KUBERNETES_COMMANDS, "k8s.io/kubernetes",
                       tuple(f"k8s.io/kubernetes/cmd/{b}" for b in _KUBERNETES_COMMANDS))
ETCD = Component("etcd", versions.ETCD, ("etcd",), "go.etcd.io/etcd/server/v3", ("go.etcd.io/etcd/server/v3",))
HEADSCALE = Component("headscale", versions.HEADSCALE, ("headscale",), "github.com/juanfont/headscale",
                      ("github.com/juanfont/headscale/cmd/headscale",))
TAILSCALE = Component("tailscale", versions.TAILSCALE, ("tailscaled", "tailscale"), "tailscale.com",
                      ("tailscale.com/cmd/tailscaled", "tailscale.com/cmd/tailscale"),
                      tags="ts_omit_aws")  # no AWS SSM state store: no AWS SDK compiled in
_CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
CONTAINERD = Component(
    "containerd", versions.CONTAINERD, ("containerd", "containerd-shim-runc-v2", "ctr"), _CONTAINERD_MODULE,
    tuple(f"{_CONTAINERD_MODULE}/cmd/{b}" for b in ("containerd", "containerd-shim-runc-v2", "ctr")),
    tags="urfave_cli_no_docs no_btrfs osusergo netgo static_build",
)
RUNC = Component("runc", versions.RUNC, ("runc",), "github.com/opencontainers/runc", (".",),
                 tags="seccomp urfave_cli_no_docs", in_module=True, cgo=True,
                 drop_replaces=("github.com/opencontainers/selinux",))
_CNI_MODULE = "github.com/containernetworking/plugins"
CNI_PLUGINS = Component(
    "cni-plugins", versions.CNI_PLUGINS, ("bridge", "host-local", "loopback", "portmap"), _CNI_MODULE,
    tuple(f"{_CNI_MODULE}/plugins/{p}" for p in ("main/bridge", "ipam/host-local", "main/loopback", "meta/portmap")),
)
# kind's node image (hack/kind): kubeadm bootstraps each node, and its baked CNI wires pods with
# ptp. Components of their own, so that adding them leaves the cached Kubernetes and CNI sets as
# they are.
KUBEADM = Component("kubeadm", versions.KUBERNETES, ("kubeadm",), KUBERNETES.module, ("k8s.io/kubernetes/cmd/kubeadm",))
CNI_PTP = Component("cni-ptp", versions.CNI_PLUGINS, ("ptp",), _CNI_MODULE, (f"{_CNI_MODULE}/plugins/main/ptp",))
COREDNS_DROPPED_PLUGINS = ("azure", "clouddns", "route53", "dnssec", "etcd", "geoip", "trace")
"""Plugins that need a cloud SDK (Azure, Google Cloud DNS, Route 53; ``dnssec`` signs online with
keys it may read from AWS Secrets Manager), an outside service (etcd, a MaxMind database) or a
tracing backend (Zipkin, Datadog). No Corefile of this project uses them, and in CoreDNS 1.12 they
are the only importers of those SDKs."""
COREDNS = Component("coredns", versions.COREDNS, ("coredns",), "github.com/coredns/coredns", (".",),
                    in_module=True, drop_plugins=COREDNS_DROPPED_PLUGINS)
KIND = Component("kind", versions.KIND, ("kind",), "sigs.k8s.io/kind", ("sigs.k8s.io/kind",))
CYCLONUS = Component("cyclonus", versions.CYCLONUS, ("cyclonus",), "github.com/mattfenwick/cyclonus",
                     ("github.com/mattfenwick/cyclonus/cmd/cyclonus",))
HELM = Component("helm", versions.HELM, ("helm",), "helm.sh/helm/v3", ("helm.sh/helm/v3/cmd/helm",),
                 x_version="helm.sh/helm/v3/internal/version.version")
_PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS = Component("prometheus", versions.PROMETHEUS, ("prometheus", "promtool"), _PROMETHEUS_MODULE,
                       (f"{_PROMETHEUS_MODULE}/cmd/prometheus", f"{_PROMETHEUS_MODULE}/cmd/promtool"),
                       tags="remove_all_sd",  # static targets only: no cloud SDKs compiled in
                       x_version="github.com/prometheus/common/version.Version")
CERT_MANAGER = Component("cert-manager", versions.CERT_MANAGER, ("cert-manager-controller",),
                         "github.com/cert-manager/cert-manager", (".",), main="certmanager")
GATEWAY_CONFORMANCE = Component(
    "gateway-conformance", versions.GATEWAY_API, ("gateway-conformance", "echo-basic"),
    "sigs.k8s.io/gateway-api/conformance", (".", "sigs.k8s.io/gateway-api/conformance/echo-basic"),
    main="gatewayconformance", replaces=(f"sigs.k8s.io/gateway-api=sigs.k8s.io/gateway-api@v{versions.GATEWAY_API}",))
"""The Gateway API's conformance suite run against tailnet Gateways (hack/gatewayconformance), and
its echo backend, which the suite's base manifests run (as an image built here)."""
METALLB = Component("metallb", versions.METALLB, ("metallb-controller",), "go.universe.tf/metallb",
                    ("go.universe.tf/metallb/controller",))
COMPONENTS = (ETCD, KUBERNETES, HEADSCALE, TAILSCALE, CONTAINERD, RUNC, CNI_PLUGINS, COREDNS, KIND, CYCLONUS, HELM,
              CERT_MANAGER, PROMETHEUS, METALLB, KUBEADM, CNI_PTP, GATEWAY_CONFORMANCE)

_MIN_GO = (1, 26)

VERSION_ENV = {"headscale": "TAILNET_HEADSCALE_VERSION", "tailscale": "TAILNET_TAILSCALE_VERSION"}
"""Components whose version an environment variable may choose (the interop matrix)."""
_RANGES = {"headscale": versions.HEADSCALE_RANGE, "tailscale": versions.TAILSCALE_RANGE}

# --- the sets each command builds -------------------------------------------------------------

_HOST_TIER = (ETCD, KUBERNETES, HEADSCALE)
"""The control plane (etcd, kube-apiserver, kube-controller-manager, kubectl) and Headscale."""
_NODE = (CONTAINERD, RUNC, CNI_PLUGINS, COREDNS)
"""The local node's runtime and its cluster DNS (the kubelet, scheduler and proxy are Kubernetes')."""

SETS: dict[str, tuple[Component, ...]] = {
    "run": (*_HOST_TIER, *_NODE),
    # In the order the suite first needs them (e2e/conftest.py runs the tests that need fewer
    # binaries first): Kubernetes, the longest, starts at once beside Headscale and tailscale.
    "test": (KUBERNETES, HEADSCALE, TAILSCALE, ETCD, PROMETHEUS, *_NODE, HELM, CERT_MANAGER, METALLB, CYCLONUS,
             GATEWAY_CONFORMANCE),
    "bench": (*_HOST_TIER, *_NODE, TAILSCALE),
    "interop": (*_HOST_TIER, TAILSCALE),
    "chaos": (*_HOST_TIER, TAILSCALE),
    "e2e": (KIND, *_HOST_TIER, TAILSCALE, COREDNS, HELM, CERT_MANAGER, METALLB, CYCLONUS, GATEWAY_CONFORMANCE,
            KUBEADM, CONTAINERD, RUNC, CNI_PLUGINS, CNI_PTP),  # the last five: kind's node image
    "all": COMPONENTS,
}
"""Each command's components: what it starts, found from the ``binary(...)`` calls it reaches."""
_NODE_ONLY_SETS = frozenset({"run", "test", "bench"})
"""Sets whose node components are needed only where the local node can run."""


def node_expected(environ: dict[str, str] | None = None, euid: int | None = None) -> bool:
    """Whether ``make run`` / ``make test`` will start the local node: it needs root, and
    ``$TAILNET_LOCALENV_NODE=0`` turns it off (hack/localenv checks the rest when it starts)."""
    env = os.environ if environ is None else environ
    uid = os.geteuid() if euid is None else euid
    return uid == 0 and env.get("TAILNET_LOCALENV_NODE", "1") != "0"


def set_components(name: str, *, node: bool) -> tuple[Component, ...]:
    """The pinned (or env-selected) components of the set ``name``; without the local node the
    node's own components are left out of the sets that only need them for it."""
    if name not in SETS:
        raise KeyError(f"unknown set {name!r} (known: {', '.join(SETS)})")
    members = SETS[name]
    if not node and name in _NODE_ONLY_SETS:
        members = tuple(c for c in members if c not in _NODE)
    return tuple(selected(c) for c in members)


def at_version(component: Component, version: str) -> Component:
    """``component`` built from another version of the same module (same binaries and flags)."""
    if version == component.version:
        return component
    if component.name not in _RANGES:
        raise KeyError(f"{component.name} is pinned to {component.version}; only {sorted(_RANGES)} have ranges")
    return dataclasses.replace(component, version=version)


def selected(component: Component) -> Component:
    """The version of ``component`` this process uses: the pin, or the one its env var names.

    The env var must name a version of the component's range in ``hack/versions.py``.
    """
    variable = VERSION_ENV.get(component.name)
    wanted = os.environ.get(variable, "") if variable else ""
    if not wanted:
        return component
    if wanted not in _RANGES[component.name]:
        raise KeyError(f"${variable}={wanted} is not in the {component.name} range {_RANGES[component.name]}")
    return at_version(component, wanted)


def parse_spec(spec: str) -> Component:
    """``name`` (the pinned or env-selected version) or ``name@version`` (a version of its range)."""
    name, _, version = spec.partition("@")
    component = next((c for c in COMPONENTS if c.name == name), None)
    if component is None:
        raise KeyError(f"unknown component {name!r}")
    if not version:
        return selected(component)
    if version != component.version and version not in _RANGES.get(name, ()):
        raise KeyError(f"{name} {version} is not listed in hack/versions.py")
    return at_version(component, version)


WaitHook = Callable[[], AbstractContextManager[object]]
_wait_hook: WaitHook = contextlib.nullcontext
"""What :func:`binary` wraps a build or a wait for a build in (see :func:`set_wait_hook`)."""


def set_wait_hook(hook: WaitHook) -> None:
    """Wrap every build that :func:`binary` waits for in ``hook()``: the test suite pauses a
    test's timeout there, since a component built when first needed is not the test's time."""
    global _wait_hook
    _wait_hook = hook


def binary(name: str) -> Path:
    """The cached path of one binary, building its component first when it is missing (or
    waiting for the process that holds its lock, such as ``make test``'s background build)."""
    for component in COMPONENTS:
        if name in component.binaries:
            chosen = selected(component)
            if not chosen.is_built():
                with _wait_hook():
                    build(chosen)
            return chosen.path(name)
    raise KeyError(f"unknown binary {name!r}")


# --- build durations --------------------------------------------------------------------------

TYPICAL_SECONDS = {
    "kubernetes": 689, "prometheus": 600, "tailscale": 372, "cert-manager": 306, "coredns": 267, "headscale": 254,
    "etcd": 194, "helm": 149, "metallb": 148, "containerd": 144, "cyclonus": 109, "runc": 32, "kind": 11,
    "cni-plugins": 11, "kubeadm": 200, "cni-ptp": 11, "gateway-conformance": 119,
}
"""Seconds of a cold build, one component after another on 2 cores, before the durations of
this machine's own builds are recorded: they order the first builds and estimate what is left."""
_UNKNOWN_SECONDS = 120.0


def timings_path() -> Path:
    return cache_root() / "bin" / ".timings.json"


def load_timings(path: Path | None = None) -> dict[str, dict[str, float | str | int]]:
    """The recorded builds, ``{"<name>-<version>": {"seconds", "finished", "beside"}}``; a
    missing or unreadable file is an empty record (it only informs estimates)."""
    try:
        data = json.loads((path or timings_path()).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


_TIMINGS_GUARD = threading.Lock()


def record_timing(component: Component, seconds: float, *, beside: int = 0, path: Path | None = None,
                  now: dt.datetime | None = None) -> None:
    """Record the last build of ``component`` (``beside``: how many other compiles ran at the
    same time). Readers and writers of other processes are serialised by a lock file, and the
    file is replaced atomically."""
    target = path or timings_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    with _TIMINGS_GUARD, (target.parent / ".timings.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = load_timings(target)
        data[component.key] = {"seconds": round(seconds, 1), "finished": stamp, "beside": beside}
        tmp = target.with_name(f".timings-{os.getpid()}-{threading.get_ident()}.json")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, target)


def last_build(component: Component, timings: dict[str, dict[str, float | str | int]]) -> float | None:
    """Seconds the last recorded build of this version took; else of the component's most
    recently built other version; None when none is recorded."""
    exact = timings.get(component.key)
    if exact is not None:
        return float(exact["seconds"])
    others = [v for k, v in timings.items() if k.rpartition("-")[0] == component.name]
    if not others:
        return None
    return float(max(others, key=lambda v: str(v.get("finished", "")))["seconds"])


def estimate(component: Component, timings: dict[str, dict[str, float | str | int]]) -> float:
    recorded = last_build(component, timings)
    if recorded is not None:
        return recorded
    return float(TYPICAL_SECONDS.get(component.name, _UNKNOWN_SECONDS))


def longest_first(components: Iterable[Component], timings: dict[str, dict[str, float | str | int]]
                  ) -> list[Component]:
    """The build order: longest estimate first, ties in the given order."""
    listed = list(components)
    return sorted(listed, key=lambda c: -estimate(c, timings))


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f} min"


def progress_line(verb: str, component: Component, *, position: int, total: int, last: float | None,
                  typical: float, left: Sequence[Component], left_seconds: float, took: float | None = None) -> str:
    """One line of progress: ``binaries [3/7] building kubernetes 1.36.3 (last build 11 min);
    left: coredns, headscale (~8 min of building)``."""
    known = (f"last build {_duration(last)}" if last is not None
             else f"no build recorded, typically {_duration(typical)}")
    done = f" in {_duration(took)}" if took is not None else ""
    rest = (f"left: {', '.join(c.name if c.version == _pin(c) else c.key for c in left)} "
            f"(~{_duration(left_seconds)} of building)") if left else "nothing left after it"
    return f"binaries [{position}/{total}] {verb} {component.name} {component.version}{done} ({known}); {rest}"


def _pin(component: Component) -> str:
    return next((c.version for c in COMPONENTS if c.name == component.name), component.version)


# --- scheduling -------------------------------------------------------------------------------

SECOND_BUILD_MIN_FREE = 6 * 1024**3
"""Bytes of MemAvailable below which no second compile starts beside a running one."""


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemAvailable`` in bytes; None where the kernel does not tell (no limit is applied)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_jobs() -> int:
    """Compiles at a time: ``$TAILNET_BUILD_JOBS``, else 2 (1 on a one-CPU machine)."""
    wanted = os.environ.get("TAILNET_BUILD_JOBS", "")
    if wanted.isdigit() and int(wanted) > 0:
        return int(wanted)
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def may_start(running: int, jobs: int, available: int | None, min_free: int = SECOND_BUILD_MIN_FREE) -> bool:
    """Whether one more compile may start now: below ``jobs``, and beside a running one only
    with ``min_free`` bytes available. With nothing running one always may (progress first)."""
    if running == 0:
        return True
    if running >= jobs:
        return False
    return available is None or available >= min_free


P = TypeVar("P")


class Busy(Exception):
    """Another process holds the component's lock (and the caller asked not to wait)."""


@dataclass
class Failure:
    component: Component
    error: str


class Claim(Protocol):
    """What a builder holds while it compiles a component: its lock, released by ``close``."""

    def close(self) -> None: ...


class _Unlocked:
    def close(self) -> None:
        pass


def _no_lock(component: Component) -> Claim | None:
    return _Unlocked()


@dataclass
class Pipeline(Generic[P]):
    """Prepare components one after another on one thread; compile up to ``jobs`` of them at a
    time, memory permitting, in the order they were prepared.

    ``prepare(component)`` returns what ``compile`` takes, or None (cached already: nothing to
    do). Right before a compile starts, ``claim(component)`` takes the component for this
    process: it returns the :class:`Claim` held during the compile, or None (another process
    built it meanwhile), or raises :class:`Busy` (another process is building it: the next
    prepared component goes first, and this one is claimed again every ``poll`` seconds).
    ``discard(prepared)`` cleans up what is not compiled. Any other exception fails that
    component only.
    """

    components: Sequence[Component]
    prepare: Callable[[Component], P | None]
    compile: Callable[[Component, P, int], float | None]
    """``compile(component, prepared, beside)``: ``beside`` is how many compiles run next to it;
    it may return the seconds the whole build took (preparation included) for the progress line."""
    claim: Callable[[Component], Claim | None] = _no_lock
    discard: Callable[[P], None] = lambda prepared: None
    jobs: int = 2
    available: Callable[[], int | None] = mem_available
    min_free: int = SECOND_BUILD_MIN_FREE
    estimates: dict[str, float] = field(default_factory=dict)
    last: dict[str, float | None] = field(default_factory=dict)
    report: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    poll: float = 5.0
    """Seconds between looks at the memory, or at another process's lock, while a compile waits."""
    failures: list[Failure] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    """Component keys in the order their compiles started."""

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[tuple[Component, P]] = []
        self._prepared_all = False
        self._running = 0
        self._finished: set[str] = set()

    def run(self) -> list[Failure]:
        preparer = threading.Thread(target=self._prepare_all, name="binaries-prepare", daemon=True)
        preparer.start()
        compiles: list[threading.Thread] = []
        with self._cond:
            while True:
                if self._prepared_all and not self._ready and self._running == 0:
                    break
                if self._ready and may_start(self._running, self.jobs, self.available() if self._running else None,
                                             self.min_free) and self._take_next(compiles):
                    continue
                self._cond.wait(self.poll if self._ready else None)
        preparer.join()
        for thread in compiles:
            thread.join()
        return self.failures

    def _take_next(self, compiles: list[threading.Thread]) -> bool:
        """Claim the first prepared component no other process is building and start its
        compile (one found built by now is reported cached instead); False when every prepared
        one is busy elsewhere. Called with ``_cond`` held."""
        for index, (component, prepared) in enumerate(self._ready):
            claim: Claim | Exception | None
            try:
                claim = self.claim(component)
            except Busy:
                continue
            except Exception as exc:
                claim = exc
            del self._ready[index]
            if isinstance(claim, Exception):
                self.discard(prepared)
                self._fail(component, claim)
            elif claim is None:
                self.discard(prepared)
                self._finished.add(component.key)
                self._say("cached", component, len(self._finished))
            else:
                self._running += 1
                self.started.append(component.key)
                self._say("building", component, len(self.started))
                thread = threading.Thread(target=self._compile_one,
                                          args=(component, prepared, claim, self._running - 1),
                                          name=f"binaries-{component.key}", daemon=True)
                compiles.append(thread)
                thread.start()
            return True
        return False

    def _left(self, current: Component) -> list[Component]:
        return [c for c in self.components if c.key not in self._finished and c.key != current.key]

    def _say(self, verb: str, component: Component, position: int, took: float | None = None) -> None:
        left = self._left(component)
        self.report(progress_line(
            verb, component, position=position, total=len(self.components), last=self.last.get(component.key),
            typical=self.estimates.get(component.key, _UNKNOWN_SECONDS), left=left,
            left_seconds=sum(self.estimates.get(c.key, _UNKNOWN_SECONDS) for c in left), took=took))

    def _prepare_all(self) -> None:
        try:
            for component in self.components:
                self._prepare_one(component)
        finally:  # the compiles of what is ready still finish, and run() returns
            with self._cond:
                self._prepared_all = True
                self._cond.notify_all()

    def _prepare_one(self, component: Component) -> None:
        try:
            result = self.prepare(component)
        except Exception as exc:  # one component's failure is reported; the others go on
            with self._cond:
                self._fail(component, exc)
            return
        with self._cond:
            if result is None:
                self._finished.add(component.key)
                self._say("cached", component, len(self._finished))
            else:
                self._ready.append((component, result))
            self._cond.notify_all()

    def _compile_one(self, component: Component, prepared: P, claim: Claim, beside: int) -> None:
        started = time.monotonic()
        try:
            took = self.compile(component, prepared, beside)
        except Exception as exc:  # reported below; the other compiles go on
            with self._cond:
                self._fail(component, exc)
        else:
            with self._cond:
                self._finished.add(component.key)
                self._say("built", component, len(self._finished),
                          took=time.monotonic() - started if took is None else took)
        finally:
            claim.close()
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _fail(self, component: Component, exc: BaseException) -> None:
        """Report a component's failure; called with ``_cond`` held."""
        lines = [line for line in str(exc).splitlines() if line.strip()]
        last = lines[-1] if lines else repr(exc)
        self._finished.add(component.key)
        self.failures.append(Failure(component, str(exc) or repr(exc)))
        self.report(f"binaries: {component.name} {component.version} FAILED: {last}")
        self._cond.notify_all()


# --- the Go builds ----------------------------------------------------------------------------

def require_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise MissingToolError("Go >= 1.26 is required to build the test binaries: install it from go.dev/dl")
    out = subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"go(\d+)\.(\d+)", out)
    if match is None or (int(match[1]), int(match[2])) < _MIN_GO:
        raise MissingToolError(f"Go >= 1.26 is required, found: {out.strip()}")
    return go


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    full_env = {**os.environ, "GOFLAGS": "-mod=mod", "GOWORK": "off", **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


@dataclass
class Workspace:
    """A component ready to compile: its module set up and every module it needs downloaded.
    Holds its temporary directory until :func:`compile_workspace` (or ``close``)."""

    go: str
    work: Path
    ldflags: str
    tmp: tempfile.TemporaryDirectory[str]
    prepare_seconds: float

    def close(self) -> None:
        self.tmp.cleanup()


def _lock(component: Component, *, wait: bool) -> IO[str] | None:
    """The component's per-version lock, or None when another process holds it and not ``wait``."""
    cache_root().mkdir(parents=True, exist_ok=True)
    lock = (cache_root() / f".build-{component.name}-{component.version}.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def ldflags(component: Component) -> str:
    if component.module == KUBERNETES.module:
        major, minor = component.version.split(".")[:2]
        return ("-s -w"
                f" -X k8s.io/component-base/version.gitVersion=v{component.version}"
                f" -X k8s.io/component-base/version.gitMajor={major}"
                f" -X k8s.io/component-base/version.gitMinor={minor}")
    if component.x_version:
        return f"-s -w -X {component.x_version}=v{component.version}"
    return "-s -w"


def claim(component: Component) -> IO[str] | None:
    """The component's lock for its compile; None when it is built by now (the lock is not
    kept). Raises :class:`Busy` while another process holds it."""
    lock = _lock(component, wait=False)
    if lock is None:
        raise Busy(component.key)
    if component.is_built():
        lock.close()
        return None
    return lock


def prepare(component: Component) -> Workspace | None:
    """Set up the component's build and download what it needs (no lock: another process may
    prepare it too, and the first to :func:`claim` it compiles); None when it is cached."""
    if component.is_built():
        return None
    started = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix=f"{component.name}-build-")
    try:
        go = require_go()
        work = _set_up(go, component, Path(tmp.name))
        tags = ["-tags", component.tags] if component.tags else []
        _run([go, "list", "-deps", *tags, *component.packages], cwd=work,
             env={"CGO_ENABLED": "1" if component.cgo else "0"})  # downloads, compiles nothing
    except BaseException:
        tmp.cleanup()
        raise
    return Workspace(go, work, ldflags(component), tmp, time.monotonic() - started)


def _set_up(go: str, component: Component, tmp: Path) -> Path:
    """The directory ``go build`` runs in, with the module and its requirements resolved."""
    if component.module == KUBERNETES.module:
        return _set_up_kubernetes(go, component, tmp)
    if component.in_module:
        return _set_up_in_module(go, component, tmp)
    _throwaway_module(go, tmp)
    if component.main:
        shutil.copy(Path(__file__).parent / component.main / "main.go", tmp / "main.go")
    for replace in component.replaces:
        _run([go, "mod", "edit", f"-replace={replace}"], cwd=tmp)
    _run([go, "get", f"{component.module}@v{component.version}"], cwd=tmp)
    if not component.main:
        _adopt_sums(go, component, tmp)
    return tmp


def _set_up_kubernetes(go: str, component: Component, work: Path) -> Path:
    minor_patch = component.version.split(".", 1)[1]
    _throwaway_module(go, work)
    gomod = _module_gomod(go, component.module, f"v{component.version}", work)
    staged = sorted(set(re.findall(r"(k8s\.io/[a-z0-9-]+) => \./staging", gomod)))
    with (work / "go.mod").open("a") as f:
        for module in staged:
            f.write(f"replace {module} => {module} v0.{minor_patch}\n")
    _run([go, "get", f"{component.module}@v{component.version}"], cwd=work)
    return work


def _set_up_in_module(go: str, component: Component, tmp: Path) -> Path:
    """A writable copy of the module, so that its own go.mod (relative replaces, go.sum) holds."""
    info = json.loads(_run([go, "mod", "download", "-json", f"{component.module}@v{component.version}"], cwd=tmp))
    work = tmp / "src"
    shutil.copytree(info["Dir"], work)
    work.chmod(0o755)
    for path in work.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    for old in component.drop_replaces:
        _run([go, "mod", "edit", f"-dropreplace={old}"], cwd=work)
    if component.drop_plugins:
        registry = work / "core" / "plugin" / "zplugin.go"
        registry.write_text(without_plugins(registry.read_text(), component.module, component.drop_plugins))
    return work


def without_plugins(zplugin: str, module: str, dropped: Iterable[str]) -> str:
    """CoreDNS's generated plugin registry (``core/plugin/zplugin.go``) without the imports of
    the ``dropped`` plugins; every other line as it was."""
    gone = {f'_ "{module}/plugin/{name}"' for name in dropped}
    return "".join(line for line in zplugin.splitlines(keepends=True) if line.strip() not in gone)


def _adopt_sums(go: str, component: Component, work: Path) -> None:
    """Add the released module's own go.sum lines to the throwaway module's.

    The build then checks its dependencies against the hashes the release pinned (the release's
    go.sum is part of its module zip, itself checked against the checksum database) instead of
    asking the checksum database for each: it does not know every pseudo-version a release
    requires (Headscale 0.28.0's tailsql answers 404 there).
    """
    info = json.loads(_run([go, "mod", "download", "-json", f"{component.module}@v{component.version}"], cwd=work))
    released = Path(info["Dir"]) / "go.sum"
    if not released.is_file():
        return
    ours = work / "go.sum"
    lines = ours.read_text().splitlines() if ours.exists() else []
    known = set(lines)
    lines += [line for line in released.read_text().splitlines() if line.strip() and line not in known]
    ours.write_text("\n".join(lines) + "\n")


def default_binary_name(package: str) -> str:
    """The file ``go build -o DIR/`` writes for a main package: its last path element, or the
    one before a major-version suffix (``.../server/v3`` -> ``server``)."""
    parts = package.rstrip("/").split("/")
    if len(parts) > 1 and re.fullmatch(r"v[0-9]+", parts[-1]):
        return parts[-2]
    return parts[-1]


def build_commands(go: str, component: Component, staging: Path, ldflags: str) -> list[list[str]]:
    """The ``go build`` invocations of a component: one for all its binaries when each is named
    after its package (the links then run beside the other compiles), else one per binary."""
    tags = ["-tags", component.tags] if component.tags else []
    base = [go, "build", "-trimpath", *tags, "-gcflags=all=-dwarf=false", "-ldflags", ldflags]
    pairs = list(zip(component.binaries, component.packages, strict=True))
    if len(pairs) > 1 and all(b == default_binary_name(p) for b, p in pairs):
        return [[*base, "-o", f"{staging}/", *component.packages]]
    return [[*base, "-o", str(staging / b), p] for b, p in pairs]


def compile_workspace(component: Component, workspace: Workspace, beside: int = 0) -> float:
    """Compile a prepared component into the cache (its lock held by the caller); return the
    seconds the whole build (preparation included) took, and record them."""
    try:
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix=f".{component.name}-", dir=cache_root()))
        try:
            for cmd in build_commands(workspace.go, component, staging, workspace.ldflags):
                _run(cmd, cwd=workspace.work, env={"CGO_ENABLED": "1" if component.cgo else "0"})
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a failed build leaves nothing in the cache
            raise
        _install_into(component, staging)
        elapsed = workspace.prepare_seconds + time.monotonic() - started
    finally:
        workspace.close()
    try:
        record_timing(component, elapsed, beside=beside)
    except OSError as exc:  # the record only informs estimates
        print(f"binaries: could not record the build time of {component.key}: {exc}", file=sys.stderr)
    return elapsed


def _install_into(component: Component, staging: Path) -> None:
    """Move freshly built binaries into the versioned cache directory atomically."""
    component.directory.parent.mkdir(parents=True, exist_ok=True)
    final = component.directory
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def _throwaway_module(go: str, workdir: Path) -> None:
    _run([go, "mod", "init", "local/testbinaries"], cwd=workdir)


def module_dir(module: str, version: str) -> Path:
    """The unpacked files of ``module@v<version>`` in Go's module cache (downloaded when missing):
    where tests read a component's own manifests, such as its CRDs."""
    go = require_go()
    with tempfile.TemporaryDirectory(prefix="module-") as tmp:
        info = json.loads(_run([go, "mod", "download", "-json", f"{module}@v{version}"], cwd=Path(tmp)))
    return Path(info["Dir"])


def _module_gomod(go: str, module: str, version: str, cwd: Path) -> str:
    info = json.loads(_run([go, "mod", "download", "-json", f"{module}@{version}"], cwd=cwd))
    return Path(info["GoMod"]).read_text()


def build(component: Component) -> float:
    """Build one component unless its binaries are cached; return the seconds it took.

    A per-version lock file serialises builders of the same version (two worktrees, or the
    interop matrix beside a background build): the second waits and then finds it cached.
    """
    if component.is_built():
        return 0.0
    timings = load_timings()
    print(progress_line("building", component, position=1, total=1, last=last_build(component, timings),
                        typical=estimate(component, timings), left=[], left_seconds=0),
          file=sys.stderr, flush=True)
    lock = _lock(component, wait=True)
    assert lock is not None
    try:
        workspace = prepare(component)
        if workspace is None:  # another process built it while this one waited
            return 0.0
        elapsed = compile_workspace(component, workspace)
    finally:
        lock.close()
    print(f"built {component.name} {component.version} in {elapsed:.0f}s -> {component.directory}",
          file=sys.stderr, flush=True)
    return elapsed


def build_all(components: Sequence[Component], *, jobs: int | None = None, in_order: bool = False
              ) -> list[Failure]:
    """Build every component not cached yet through the :class:`Pipeline`: longest first (the
    least time for all of them), or ``in_order`` as given (the order something will need them)."""
    unique = list({c.key: c for c in components}.values())
    missing = [c for c in unique if not c.is_built()]
    if not missing:
        return []
    require_go()
    timings = load_timings()
    ordered = missing if in_order else longest_first(missing, timings)
    pipeline: Pipeline[Workspace] = Pipeline(
        ordered, prepare, compile_workspace, claim=claim, discard=Workspace.close, jobs=jobs or default_jobs(),
        estimates={c.key: estimate(c, timings) for c in ordered},
        last={c.key: last_build(c, timings) for c in ordered})
    return pipeline.run()


_USAGE = ("usage: python -m hack.binaries [build [--set NAME]... [--jobs N] [--in-order] [COMPONENT[@VERSION]...] "
          "| path BINARY | list]")


@dataclass(frozen=True)
class BuildRequest:
    """What ``build`` was asked for."""

    components: list[Component]
    jobs: int | None = None
    """Compiles at a time; None: :func:`default_jobs`."""
    in_order: bool = False
    """Build in the order named (first needed first) instead of longest first."""


def _parse_build(args: list[str]) -> BuildRequest:
    """``build [--set NAME]... [--jobs N] [--in-order] [SPEC...]`` (every pinned component when
    nothing is named)."""
    wanted: list[Component] = []
    jobs: int | None = None
    in_order = False
    named = False
    rest = list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--in-order":
            in_order = True
        elif arg in ("--set", "--jobs") or arg.startswith(("--set=", "--jobs=")):
            option, _, value = arg.partition("=")
            if not value:
                if not rest:
                    raise KeyError(f"{option} needs a value")
                value = rest.pop(0)
            if option == "--jobs":
                if not value.isdigit() or int(value) < 1:
                    raise KeyError(f"--jobs wants a positive number, not {value!r}")
                jobs = int(value)
            else:
                wanted += set_components(value, node=node_expected())
                named = True
        elif arg.startswith("-"):
            raise KeyError(f"unknown option {arg!r}")
        else:
            wanted.append(parse_spec(arg))
            named = True
    if not named:
        wanted = [selected(c) for c in COMPONENTS]
    return BuildRequest(wanted, jobs, in_order)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "build"
    try:
        if command == "build":
            try:
                request = _parse_build(argv[1:])
            except KeyError as exc:
                print(f"error: {exc.args[0]}", file=sys.stderr)
                return 2
            started = time.monotonic()
            failures = build_all(request.components, jobs=request.jobs, in_order=request.in_order)
            if failures:
                print(f"binaries: {len(failures)} of {len(request.components)} did not build:", file=sys.stderr)
                for failure in failures:
                    print(f"--- {failure.component.name} {failure.component.version}\n{failure.error}",
                          file=sys.stderr)
                return 1
            print(f"all binaries ready under {cache_root() / 'bin'} "
                  f"({time.monotonic() - started:.0f}s spent building)", file=sys.stderr)
        elif command == "path" and len(argv) == 2:
            print(binary(argv[1]))
        elif command == "list":
            for pinned in COMPONENTS:
                for version in dict.fromkeys((pinned.version, *_RANGES.get(pinned.name, ()))):
                    component = at_version(pinned, version)
                    state = "cached" if component.is_built() else "missing"
                    print(f"{component.name:12} {component.version:10} {state:8} {component.directory}")
        else:
            print(_USAGE, file=sys.stderr)
            return 2
    except MissingToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
