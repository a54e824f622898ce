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
  controllers the way that command does (test-only: the tests issue certificates with it).
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

Usage: ``python -m hack.binaries [build [COMPONENT[@VERSION]...] | path BINARY | list]``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

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
    """Build inside a copy of the module itself (it needs its own go.mod, with cgo)."""
    drop_replaces: tuple[str, ...] = ()
    """``replace`` directives of that go.mod whose targets the published module lacks."""
    x_version: str = ""
    """A Go variable that ``-ldflags -X`` sets to ``v<version>`` (what ``<binary> version`` prints)."""
    main: str = ""
    """A main package of this repository (a directory under hack/) built against the module."""

    @property
    def directory(self) -> Path:
        return cache_root() / "bin" / f"{self.name}-{self.version}"

    def path(self, binary: str) -> Path:
        return self.directory / binary

    def is_built(self) -> bool:
        return all(self.path(b).is_file() for b in self.binaries)


KUBERNETES = Component(
    "kubernetes", versions.KUBERNETES,
    ("kube-apiserver", "kube-controller-manager", "kubectl", "kube-scheduler", "kubelet", "kube-proxy"),
)
ETCD = Component("etcd", versions.ETCD, ("etcd",), "go.etcd.io/etcd/server/v3", ("go.etcd.io/etcd/server/v3",))
HEADSCALE = Component("headscale", versions.HEADSCALE, ("headscale",), "github.com/juanfont/headscale",
                      ("github.com/juanfont/headscale/cmd/headscale",))
TAILSCALE = Component("tailscale", versions.TAILSCALE, ("tailscaled", "tailscale"), "tailscale.com",
                      ("tailscale.com/cmd/tailscaled", "tailscale.com/cmd/tailscale"))
_CONTAINERD_MODULE = "github.com/containerd/containerd/v2"
CONTAINERD = Component(
    "containerd", versions.CONTAINERD, ("containerd", "containerd-shim-runc-v2", "ctr"), _CONTAINERD_MODULE,
    tuple(f"{_CONTAINERD_MODULE}/cmd/{b}" for b in ("containerd", "containerd-shim-runc-v2", "ctr")),
    tags="urfave_cli_no_docs no_btrfs osusergo netgo static_build",
)
RUNC = Component("runc", versions.RUNC, ("runc",), "github.com/opencontainers/runc", (".",),
                 tags="seccomp urfave_cli_no_docs", in_module=True,
                 drop_replaces=("github.com/opencontainers/selinux",))
_CNI_MODULE = "github.com/containernetworking/plugins"
CNI_PLUGINS = Component(
    "cni-plugins", versions.CNI_PLUGINS, ("bridge", "host-local", "loopback", "portmap"), _CNI_MODULE,
    tuple(f"{_CNI_MODULE}/plugins/{p}" for p in ("main/bridge", "ipam/host-local", "main/loopback", "meta/portmap")),
)
COREDNS = Component("coredns", versions.COREDNS, ("coredns",), "github.com/coredns/coredns",
                    ("github.com/coredns/coredns",))
KIND = Component("kind", versions.KIND, ("kind",), "sigs.k8s.io/kind", ("sigs.k8s.io/kind",))
CYCLONUS = Component("cyclonus", versions.CYCLONUS, ("cyclonus",), "github.com/mattfenwick/cyclonus",
                     ("github.com/mattfenwick/cyclonus/cmd/cyclonus",))
HELM = Component("helm", versions.HELM, ("helm",), "helm.sh/helm/v3", ("helm.sh/helm/v3/cmd/helm",),
                 x_version="helm.sh/helm/v3/internal/version.version")
_PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS = Component("prometheus", versions.PROMETHEUS, ("prometheus", "promtool"), _PROMETHEUS_MODULE,
                       (f"{_PROMETHEUS_MODULE}/cmd/prometheus", f"{_PROMETHEUS_MODULE}/cmd/promtool"),
                       x_version="github.com/prometheus/common/version.Version")
CERT_MANAGER = Component("cert-manager", versions.CERT_MANAGER, ("cert-manager-controller",),
                         "github.com/cert-manager/cert-manager", (".",), main="certmanager")
METALLB = Component("metallb", versions.METALLB, ("metallb-controller",), "go.universe.tf/metallb",
                    ("go.universe.tf/metallb/controller",))
COMPONENTS = (ETCD, KUBERNETES, HEADSCALE, TAILSCALE, CONTAINERD, RUNC, CNI_PLUGINS, COREDNS, KIND, CYCLONUS, HELM,
              CERT_MANAGER, PROMETHEUS, METALLB)

_MIN_GO = (1, 26)

VERSION_ENV = {"headscale": "TAILNET_HEADSCALE_VERSION", "tailscale": "TAILNET_TAILSCALE_VERSION"}
"""Components whose version an environment variable may choose (the interop matrix)."""
_RANGES = {"headscale": versions.HEADSCALE_RANGE, "tailscale": versions.TAILSCALE_RANGE}


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


def binary(name: str) -> Path:
    """The cached path of one binary, building its component first when it is missing."""
    for component in COMPONENTS:
        if name in component.binaries:
            chosen = selected(component)
            if not chosen.is_built():
                build(chosen)
            return chosen.path(name)
    raise KeyError(f"unknown binary {name!r}")


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


def _install_into(component: Component, staging: Path) -> None:
    """Move freshly built binaries into the versioned cache directory atomically."""
    component.directory.parent.mkdir(parents=True, exist_ok=True)
    final = component.directory
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def _build_main(component: Component) -> None:
    """Build the project's own main (``hack/<main>/main.go``) in a throwaway module that requires
    ``module@v<version>``; the main's other imports resolve to the versions that module pins."""
    go = require_go()
    with tempfile.TemporaryDirectory(prefix=f"{component.name}-build-") as tmp:
        work = Path(tmp)
        _throwaway_module(go, work)
        shutil.copy(Path(__file__).parent / component.main / "main.go", work / "main.go")
        _run([go, "get", f"{component.module}@v{component.version}"], cwd=work)
        _build_packages(go, component, work, "-s -w", cgo=False)


def _build_from_module(component: Component, ldflags: str = "-s -w") -> None:
    """Build the component's packages of ``module@v<version>`` in a throwaway module.

    ``go install pkg@version`` would be simpler, but it also asks the proxy for the module's
    version list (to report deprecations), which a proxy may refuse; requiring the exact
    version from a throwaway module needs only that version's files.
    """
    go = require_go()
    with tempfile.TemporaryDirectory(prefix=f"{component.name}-build-") as tmp:
        work = Path(tmp)
        _throwaway_module(go, work)
        _run([go, "get", f"{component.module}@v{component.version}"], cwd=work)
        _adopt_sums(go, component, work)
        _build_packages(go, component, work, ldflags, cgo=False)


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


def _build_in_module(component: Component) -> None:
    """Build inside a writable copy of the module, so that its own relative replaces hold."""
    go = require_go()
    with tempfile.TemporaryDirectory(prefix=f"{component.name}-build-") as tmp:
        info = json.loads(_run([go, "mod", "download", "-json", f"{component.module}@v{component.version}"],
                               cwd=Path(tmp)))
        work = Path(tmp) / "src"
        shutil.copytree(info["Dir"], work)
        work.chmod(0o755)
        for path in work.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        for old in component.drop_replaces:
            _run([go, "mod", "edit", f"-dropreplace={old}"], cwd=work)
        _build_packages(go, component, work, "-s -w", cgo=True)


def _build_packages(go: str, component: Component, work: Path, ldflags: str, *, cgo: bool) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{component.name}-", dir=cache_root()))
    tags = ["-tags", component.tags] if component.tags else []
    try:
        for binary_name, package in zip(component.binaries, component.packages, strict=True):
            _run([go, "build", "-trimpath", *tags, "-ldflags", ldflags, "-o", str(staging / binary_name), package],
                 cwd=work, env={"CGO_ENABLED": "1" if cgo else "0"})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed build leaves nothing in the cache
        raise
    _install_into(component, staging)


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


def _build_kubernetes(component: Component) -> None:
    go = require_go()
    version = component.version
    minor_patch = version.split(".", 1)[1]
    with tempfile.TemporaryDirectory(prefix="k8s-build-") as tmp:
        work = Path(tmp)
        _throwaway_module(go, work)
        gomod = _module_gomod(go, "k8s.io/kubernetes", f"v{version}", work)
        staged = sorted(set(re.findall(r"(k8s\.io/[a-z0-9-]+) => \./staging", gomod)))
        with (work / "go.mod").open("a") as f:
            for module in staged:
                f.write(f"replace {module} => {module} v0.{minor_patch}\n")
        _run([go, "get", f"k8s.io/kubernetes@v{version}"], cwd=work)
        major, minor = version.split(".")[:2]
        ldflags = (
            "-s -w"
            f" -X k8s.io/component-base/version.gitVersion=v{version}"
            f" -X k8s.io/component-base/version.gitMajor={major}"
            f" -X k8s.io/component-base/version.gitMinor={minor}"
        )
        staging = Path(tempfile.mkdtemp(prefix=".kubernetes-", dir=cache_root()))
        for binary_name in component.binaries:
            _run([go, "build", "-trimpath", "-ldflags", ldflags, "-o", str(staging / binary_name),
                  f"k8s.io/kubernetes/cmd/{binary_name}"], cwd=work, env={"CGO_ENABLED": "0"})
        _install_into(component, staging)


def build(component: Component) -> float:
    """Build one component unless its binaries are cached; return the seconds it took.

    A per-version lock file serialises builders of the same version (two worktrees, or the
    interop matrix beside a background build): the second waits and then finds it cached.
    """
    if component.is_built():
        return 0.0
    cache_root().mkdir(parents=True, exist_ok=True)
    with (cache_root() / f".build-{component.name}-{component.version}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if component.is_built():
            return 0.0
        return _build_locked(component)


def _build_locked(component: Component) -> float:
    started = time.monotonic()
    print(f"building {component.name} {component.version} ...", file=sys.stderr, flush=True)
    if component.name == KUBERNETES.name:
        _build_kubernetes(component)
    elif component.in_module:
        _build_in_module(component)
    elif component.main:
        _build_main(component)
    elif component.x_version:
        _build_from_module(component, f"-s -w -X {component.x_version}=v{component.version}")
    else:
        _build_from_module(component)
    elapsed = time.monotonic() - started
    print(f"built {component.name} {component.version} in {elapsed:.0f}s -> {component.directory}",
          file=sys.stderr, flush=True)
    return elapsed


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "build"
    try:
        if command == "build":
            try:
                wanted = [parse_spec(spec) for spec in argv[1:]] or [selected(c) for c in COMPONENTS]
            except KeyError as exc:
                print(f"error: {exc.args[0]}", file=sys.stderr)
                return 2
            total = sum(build(c) for c in wanted)
            print(f"all binaries ready under {cache_root() / 'bin'} ({total:.0f}s spent building)",
                  file=sys.stderr)
        elif command == "path" and len(argv) == 2:
            print(binary(argv[1]))
        elif command == "list":
            for pinned in COMPONENTS:
                for version in dict.fromkeys((pinned.version, *_RANGES.get(pinned.name, ()))):
                    component = at_version(pinned, version)
                    state = "cached" if component.is_built() else "missing"
                    print(f"{component.name:12} {component.version:10} {state:8} {component.directory}")
        else:
            print("usage: python -m hack.binaries [build [COMPONENT[@VERSION]...] | path BINARY | list]",
                  file=sys.stderr)
            return 2
    except MissingToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
