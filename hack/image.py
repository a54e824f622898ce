"""Build, cache and export the OCI images the local single-node cluster runs.

No registry is reachable from the local node, so every image is built here from local inputs
with buildah and exported as an OCI archive, which ``ctr -n k8s.io images import`` loads:

* ``pause``: FROM scratch plus a static pause program compiled from ``hack/pause/pause.c``.
* ``coredns``: FROM scratch plus the static CoreDNS that ``hack.binaries`` builds.
* ``project``: the operator and the agent, built from ``Containerfile`` on a Debian base
  (``localhost/tailnet-base``) made with debootstrap, with the Rust extension built on the host.

Each archive is named after its inputs (a content hash, or CoreDNS's version), so an unchanged
input is not rebuilt. buildah keeps its storage, run state, temporary files and CNI
configuration under ``<cache>/images``; the one file it still writes on the host (a blob-info
cache under /var/lib/containers) is removed after every build, and the host's links, mounts
and CNI directories are compared before and after.

Usage: ``python -m hack.image [build|smoke] [project|pause|coredns|base|all]``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from hack import versions
from hack.binaries import MissingToolError, binary, cache_root

REPO_ROOT = Path(__file__).resolve().parent.parent

PROJECT_REPOSITORY = "localhost/tailnet-operator"
PAUSE_REPOSITORY = "localhost/tailnet-pause"
COREDNS_REPOSITORY = "localhost/coredns"
TAILSCALE_REPOSITORY = "localhost/tailscale"
ROUTER_REPOSITORY = "localhost/tailnet-gateway-router"
BASE_REPOSITORY = "localhost/tailnet-base"

BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""What debootstrap's minbase variant lacks for the project image: Python with venv, and CA roots."""
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BASE_TRIM_DIRS = ("usr/share/man", "usr/share/info", "usr/share/locale")
BASE_TRIM_GLOBS = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*",
                   "var/cache/debconf/*-old", "var/log/*.log")
"""What the base drops after debootstrap (as Debian's slim images do); /usr/share/doc keeps only
the copyright files. Part of the base's tag, so that changing it makes a new base."""

PROJECT_FILES = ("Containerfile", "pyproject.toml", "requirements-image.lock", "README.md", "LICENSE",
                 "native/Cargo.toml", "native/Cargo.lock")
PROJECT_TREES = ("tailnet_operator", "tailnet_agent", "native/src")
"""The project image's inputs: exactly what the Containerfile copies, so that they make its tag."""
NATIVE_FILES = ("native/Cargo.toml", "native/Cargo.lock")
NATIVE_TREES = ("native/src",)
NATIVE_ENV = {"PYO3_BUILD_EXTENSION_MODULE": "1"}
"""Build an extension module, as maturin does: Python provides its symbols, libpython is not linked."""
NATIVE_IN_CONTEXT = "_artifacts/native/_native.abi3.so"
"""Where the Containerfile's ``native-prebuilt`` stage takes the host-built extension from."""

_IGNORED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", "target"})
_IGNORED_SUFFIXES = (".pyc", ".pyo", ".so", ".swp", "~")
"""Build outputs and editor files inside the copied trees (git ignores them too): not inputs."""

PAUSE_SOURCE = "hack/pause/pause.c"
PAUSE_CFLAGS = ("-static", "-Os", "-s")
NONROOT = "65532:65532"
PAUSE_USER = "65535:65535"
KEEP_PROJECT_IMAGES = 2
"""Project images (archives and cached layers) kept after a build; older ones are removed."""

_LEFTOVERS = (
    Path("/var/lib/containers/cache/blob-info-cache-v1.boltdb"),
    Path("/etc/cni/net.d/cni.lock"),
    Path("/etc/cni/net.d/87-podman-bridge.conflist"),
    Path("/var/lib/cni/networks/podman"),
)
"""Host files buildah creates despite its own root (removed again unless they were there before)."""
_EXPECTED_LEFTOVERS = frozenset({str(_LEFTOVERS[0])})
"""Left by every buildah call that copies an image; removed silently."""
_LEFTOVER_TOPS = (Path("/var/lib/containers"), Path("/etc/cni"), Path("/var/lib/cni"))
_PODMAN_BRIDGE = "cni-podman0"


class BuildError(RuntimeError):
    """A build step failed; the message ends with the tail of its output."""


@dataclass(frozen=True)
class Image:
    """One image: the reference it carries and the OCI archive that holds it."""

    ref: str
    archive: Path

    @property
    def repository(self) -> str:
        return self.ref.rsplit(":", 1)[0]


# --- pure logic: inputs, hashes, names ------------------------------------------------------


def images_dir() -> Path:
    """Everything this module writes: archives, buildah's storage and run state, the base rootfs."""
    return cache_root() / "images"


def is_ignored(relative: PurePosixPath) -> bool:
    """Whether a file inside a copied tree is a build output or editor file rather than a source."""
    in_ignored_dir = any(part in _IGNORED_DIRS or part.endswith(".egg-info") for part in relative.parts[:-1])
    return in_ignored_dir or relative.name.endswith(_IGNORED_SUFFIXES)


def collect_inputs(root: Path, files: Iterable[str], trees: Iterable[str]) -> list[str]:
    """The relative paths of ``files`` plus every non-ignored file under ``trees``, sorted."""
    found = set(files)
    for tree in trees:
        for path in (root / tree).rglob("*"):
            relative = PurePosixPath(path.relative_to(root).as_posix())
            if path.is_file() and not is_ignored(relative):
                found.add(str(relative))
    return sorted(found)


def project_inputs(root: Path = REPO_ROOT) -> list[str]:
    """The files the Containerfile copies (the staged build context holds exactly these)."""
    return collect_inputs(root, PROJECT_FILES, PROJECT_TREES)


def content_hash(root: Path, paths: Iterable[str], extra: Mapping[str, str] | None = None) -> str:
    """A sha256 over the paths, contents and executable bits of ``paths`` plus ``extra``.

    Paths are part of the hash (a rename changes it), and so is the executable bit, which COPY
    keeps; ``extra`` carries what is not a file, such as the base image's id.
    """
    digest = hashlib.sha256()
    for relative in sorted(paths):
        path = root / relative
        data = path.read_bytes()
        executable = bool(path.stat().st_mode & 0o111)
        digest.update(f"file {relative} {len(data)} {int(executable)}\n".encode())
        digest.update(data)
    for key, value in sorted((extra or {}).items()):
        digest.update(f"extra {key}={value}\n".encode())
    return digest.hexdigest()


def base_tag(suite: str, packages: Iterable[str], trim: Iterable[str] = BASE_TRIM_DIRS + BASE_TRIM_GLOBS) -> str:
    """The base image's tag: the suite plus a hash of the suite, the (unordered) packages and the trim."""
    key = "\n".join([suite, *sorted(set(packages)), "trim", *trim])
    return f"{suite}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def archive_path(ref: str, directory: Path | None = None) -> Path:
    """``<images>/<name>-<tag>.oci.tar`` for ``localhost/<name>:<tag>``."""
    repository, tag = ref.rsplit(":", 1)
    name = repository.rsplit("/", 1)[-1]
    return (directory or images_dir()) / f"{name}-{tag}.oci.tar"


def apt_mirror(suite: str, apt_dir: Path = Path("/etc/apt")) -> str:
    """The first Debian mirror the machine's apt sources use for ``suite`` (one-line or deb822)."""
    sources = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*.list")),
               *sorted((apt_dir / "sources.list.d").glob("*.sources"))]
    for source in sources:
        if source.is_file():
            text = source.read_text(errors="replace")
            found = _deb822_mirror(text, suite) if source.suffix == ".sources" else _one_line_mirror(text, suite)
            if found:
                return found
    return DEFAULT_MIRROR


def _one_line_mirror(text: str, suite: str) -> str | None:
    for line in text.splitlines():
        fields = [f for f in re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()]
        if len(fields) >= 3 and fields[0] == "deb" and fields[2] == suite:
            return fields[1].rstrip("/")
    return None


def _deb822_mirror(text: str, suite: str) -> str | None:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith((" ", "\t", "#")):
                fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and suite in fields.get("suites", "").split():
            uris = fields.get("uris", "").split()
            if uris:
                return uris[0].rstrip("/")
    return None


def read_archive(archive: Path) -> tuple[str, dict[str, Any], list[str]]:
    """The ref annotation, the image config and the layer digests of a one-image OCI archive."""
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        for required in ("oci-layout", "index.json"):
            if required not in names and f"./{required}" not in names:
                raise BuildError(f"{archive}: no {required} in the archive")
        index = _tar_json(tar, "index.json")
        descriptor = index["manifests"][0]
        manifest = _tar_json(tar, _blob(descriptor["digest"]))
        config = _tar_json(tar, _blob(manifest["config"]["digest"]))
        layers = [layer["digest"] for layer in manifest["layers"]]
    missing = [d for d in layers if _blob(d) not in names]
    if missing:
        raise BuildError(f"{archive}: layers {missing} are referenced but absent")
    return descriptor.get("annotations", {}).get("org.opencontainers.image.ref.name", ""), config, layers


def _blob(digest: str) -> str:
    algorithm, value = digest.split(":", 1)
    return f"blobs/{algorithm}/{value}"


def _tar_json(tar: tarfile.TarFile, name: str) -> dict[str, Any]:
    member = tar.extractfile(name)
    if member is None:
        raise BuildError(f"{name} is not a file in the archive")
    data: dict[str, Any] = json.load(member)
    return data


# --- host state: what buildah may leave behind ----------------------------------------------


@dataclass(frozen=True)
class HostState:
    """What a build must leave as it found: links, mounts and buildah's known host files."""

    links: frozenset[str]
    mounts: frozenset[str]
    paths: frozenset[Path]


def host_state() -> HostState:
    links = frozenset(os.listdir("/sys/class/net"))
    with open("/proc/self/mountinfo") as mountinfo:
        mounts = frozenset(line.split()[4] for line in mountinfo if line.strip())
    paths = frozenset(p for p in (*_LEFTOVERS, *_LEFTOVER_TOPS, *(p.parent for p in _LEFTOVERS)) if p.exists())
    return HostState(links, mounts, paths)


def restore_host(before: HostState) -> list[str]:
    """Undo what buildah added since ``before``; returns what was cleaned (empty when nothing)."""
    after = host_state()
    cleaned: list[str] = []
    if _PODMAN_BRIDGE in after.links - before.links:
        subprocess.run(["ip", "link", "delete", _PODMAN_BRIDGE], check=False)
        cleaned.append(f"link {_PODMAN_BRIDGE}")
    ours = str(images_dir())
    for mount in sorted(after.mounts - before.mounts, key=len, reverse=True):
        if mount == ours or mount.startswith(ours + "/"):
            subprocess.run(["umount", "--lazy", mount], check=False)
            cleaned.append(f"mount {mount}")
    for path in _LEFTOVERS:
        if path in after.paths and path not in before.paths:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            cleaned.append(str(path))
            _remove_empty_parents(path.parent, before.paths)
    return cleaned


def _remove_empty_parents(directory: Path, existed: frozenset[Path]) -> None:
    """Remove the directories buildah created for a leftover, up to one that existed before."""
    while directory not in existed and directory.is_dir() and any(
            directory == top or top in directory.parents for top in _LEFTOVER_TOPS):
        if any(directory.iterdir()):
            return
        directory.rmdir()
        directory = directory.parent


@contextlib.contextmanager
def _host_left_clean() -> Iterator[None]:
    before = host_state()
    try:
        yield
    finally:
        unexpected = [c for c in restore_host(before) if c not in _EXPECTED_LEFTOVERS]
        if unexpected:
            print(f"removed what buildah left on the host: {', '.join(unexpected)}", file=sys.stderr)


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One build at a time per cache: the staged context and buildah's storage are shared."""
    images_dir().mkdir(parents=True, exist_ok=True)
    with (images_dir() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with _host_left_clean():
            yield


# --- tools ----------------------------------------------------------------------------------


def _require(tool: str, package: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise MissingToolError(f"{tool} is required to build the images: apt-get install {package}")
    return found


def _require_root() -> None:
    if os.geteuid() != 0:
        raise MissingToolError("building the images needs root (debootstrap, buildah's vfs storage)")


def _run(cmd: list[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout


def _buildah_env() -> dict[str, str]:
    """Point buildah's CNI configuration and big temporary files into the cache directory."""
    root = images_dir()
    for sub in ("cni/net.d", "cni/bin", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "containers.conf"
    text = (f'[network]\nnetwork_backend = "cni"\nnetwork_config_dir = "{root}/cni/net.d"\n'
            f'cni_plugin_dirs = ["{root}/cni/bin"]\n')
    if not conf.is_file() or conf.read_text() != text:
        conf.write_text(text)
    return {"CONTAINERS_CONF": str(conf), "TMPDIR": str(root / "tmp"), "BUILDAH_ISOLATION": "chroot"}


def _buildah_argv(*args: str) -> list[str]:
    root = images_dir()
    return [_require("buildah", "buildah"), "--root", str(root / "storage"), "--runroot", str(root / "run"),
            "--storage-driver", "vfs", *args]


def buildah(*args: str) -> str:
    """Run buildah on this project's own storage (vfs, under the cache); return its stdout.

    Every call is checked against the host's state, so that whatever buildah leaves outside
    the cache directory is removed right away.
    """
    with _host_left_clean():
        return _run(_buildah_argv(*args), env=_buildah_env())


def image_id(ref: str) -> str | None:
    """The id of ``ref`` in this project's buildah storage, or None when it is not there."""
    try:
        out = buildah("images", "--noheading", "--no-trunc", "--format", "{{.ID}}", ref)
    except BuildError:
        return None
    return out.split()[0] if out.split() else None


def _export(ref: str, archive: Path) -> None:
    """Write ``ref`` as an OCI archive, under a temporary name first so readers never see half."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    try:
        buildah("push", "--quiet", ref, f"oci-archive:{partial}:{ref}")
        os.replace(partial, archive)
    finally:
        partial.unlink(missing_ok=True)


def _scratch_image(ref: str, files: Mapping[str, Path], entrypoint: list[str], user: str) -> None:
    """Commit ``files`` (destination -> host path) into a FROM-scratch image."""
    container = buildah("from", "scratch").strip()
    try:
        for destination, source in files.items():
            buildah("copy", "--chmod", "0755", container, str(source), destination)
        buildah("config", "--entrypoint", json.dumps(entrypoint), "--user", user, container)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)


# --- the images -----------------------------------------------------------------------------


def _ensure(image: Image, build: Callable[[], None]) -> bool:
    """Build and export ``image`` unless its archive is there; return whether it was cached."""
    if image.archive.is_file():
        return True
    with _exclusive():
        if image.archive.is_file():
            return True
        if image_id(image.ref) is None:
            build()
        _export(image.ref, image.archive)
    return False


def _pause() -> tuple[Image, bool]:
    tag = content_hash(REPO_ROOT, [PAUSE_SOURCE], {"cc": " ".join(("gcc", *PAUSE_CFLAGS))})[:12]
    image = Image(f"{PAUSE_REPOSITORY}:{tag}", archive_path(f"{PAUSE_REPOSITORY}:{tag}"))
    return image, _ensure(image, lambda: _build_pause(image.ref))


def _build_pause(ref: str) -> None:
    gcc = _require("gcc", "gcc libc6-dev")
    with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
        program = Path(tmp) / "pause"
        _run([gcc, *PAUSE_CFLAGS, "-o", str(program), str(REPO_ROOT / PAUSE_SOURCE)])
        _scratch_image(ref, {"/pause": program}, ["/pause"], PAUSE_USER)


def pause_image() -> Image:
    """The pod sandbox image: a static program that reaps children and waits for SIGTERM."""
    return _pause()[0]


def _coredns() -> tuple[Image, bool]:
    ref = f"{COREDNS_REPOSITORY}:{versions.COREDNS}"
    image = Image(ref, archive_path(ref))
    return image, _ensure(image, lambda: _scratch_image(ref, {"/coredns": binary("coredns")}, ["/coredns"], NONROOT))


def coredns_image() -> Image:
    """Cluster DNS: the pinned, statically linked CoreDNS (built from its Go module) in a scratch image."""
    return _coredns()[0]


def _tailscale() -> tuple[Image, bool]:
    ref = f"{TAILSCALE_REPOSITORY}:{versions.TAILSCALE}"
    image = Image(ref, archive_path(ref))
    files = {"/tailscaled": binary("tailscaled"), "/tailscale": binary("tailscale")}
    return image, _ensure(image, lambda: _scratch_image(ref, files, ["/tailscaled"], NONROOT))


def tailscale_image() -> Image:
    """tailscaled and its CLI (static, from their Go module) in a scratch image: the egress pod a
    user builds by hand, which the in-cluster benchmark measures the agent against."""
    return _tailscale()[0]


ECHO_BASIC_REFS = tuple(f"registry.k8s.io/gateway-api/echo-basic:{tag}" for tag in ("v1.5.1", "v1.6.0-dev.2",
                                                                                     "v1.6.0-dev.3"))
"""The names the Gateway API conformance suite's base manifests give its echo backend (v1.6.3)."""
CONFORMANCE_COREDNS_REF = "registry.k8s.io/coredns/coredns:v1.12.2"
"""The name they give CoreDNS (the UDP tests' backend, which this project does not serve)."""


def conformance_images() -> list[Image]:
    """The images the Gateway API conformance suite's base manifests run, under the names they use
    (no registry is reachable; their pull policy is IfNotPresent): its echo backend, built from the
    suite's module, and the pinned CoreDNS (run as root there, to bind port 53 as the manifests ask)."""
    directory = images_dir() / f"gateway-api-{versions.GATEWAY_API}"
    images = []
    for ref in ECHO_BASIC_REFS:
        image = Image(ref, archive_path(ref, directory))
        _ensure(image, functools.partial(_scratch_image, ref, {"/echo-basic": binary("echo-basic")}, ["/echo-basic"],
                                         NONROOT))
        images.append(image)
    coredns = Image(CONFORMANCE_COREDNS_REF, archive_path(CONFORMANCE_COREDNS_REF, directory))
    _ensure(coredns, lambda: _scratch_image(coredns.ref, {"/coredns": binary("coredns")}, ["/coredns"], "0:0"))
    return [*images, coredns]


def _layered_image(ref: str, base: str, files: Mapping[str, Path]) -> None:
    """Commit ``files`` (destination -> host path) on top of the local image ``base``."""
    container = buildah("from", base).strip()
    try:
        for destination, source in files.items():
            buildah("copy", "--chmod", "0755", container, str(source), destination)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)


def _router() -> tuple[Image, bool]:
    base = base_image()
    ref = f"{ROUTER_REPOSITORY}:{versions.TAILSCALE}-{base.rsplit(':', 1)[1]}"
    image = Image(ref, archive_path(ref))
    files = {"/usr/local/bin/tailscaled": binary("tailscaled"), "/usr/local/bin/tailscale": binary("tailscale")}
    return image, _ensure(image, lambda: _layered_image(ref, base, files))


def router_image() -> Image:
    """A TailnetGateway router image: the Debian base (a shell for the router's start script)
    plus the pinned tailscaled and CLI, standing in for the tailscale/tailscale image on the
    local node, which pulls nothing from registries."""
    return _router()[0]


def base_image() -> str:
    """The Debian base as a local image (ref), made with debootstrap unless already in storage."""
    ref = f"{BASE_REPOSITORY}:{base_tag(versions.DEBIAN_SUITE, BASE_PACKAGES)}"
    if image_id(ref) is None:
        with _exclusive():
            if image_id(ref) is None:
                _import_rootfs(ref, _base_rootfs(ref.rsplit(":", 1)[1]))
    return ref


def _base_rootfs(tag: str) -> Path:
    """A tarball of the debootstrapped rootfs, cached so that a wiped storage re-imports quickly."""
    return rootfs_tarball(images_dir() / "base" / f"{tag}.tar", BASE_PACKAGES)


def rootfs_tarball(tarball: Path, packages: Sequence[str]) -> Path:
    """``tarball``: a minimal Debian rootfs with ``packages``, made with debootstrap unless cached
    there (trimmed of what no container reads)."""
    if tarball.is_file():
        return tarball
    debootstrap = _require("debootstrap", "debootstrap")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    suite = versions.DEBIAN_SUITE
    with tempfile.TemporaryDirectory(dir=tarball.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run([debootstrap, "--variant=minbase", f"--include={','.join(packages)}", suite, str(rootfs),
              apt_mirror(suite)])
        _trim_rootfs(rootfs)
        partial = tarball.with_suffix(".partial")
        _run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(partial),
              "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "."])
        os.replace(partial, tarball)
    return tarball


def _trim_rootfs(rootfs: Path) -> None:
    """Drop documentation, translations and apt's downloads and indexes: no container reads them."""
    for directory in BASE_TRIM_DIRS:
        for path in (rootfs / directory).glob("*"):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    for pattern in BASE_TRIM_GLOBS:
        for path in rootfs.glob(pattern):
            path.unlink()
    for path in sorted((rootfs / "usr/share/doc").rglob("*"), reverse=True):
        if path.is_symlink() or (path.is_file() and path.name != "copyright"):
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def _import_rootfs(ref: str, tarball: Path) -> None:
    container = buildah("from", "scratch").strip()
    try:
        buildah("add", container, str(tarball), "/")
        buildah("config", "--env", "LANG=C.UTF-8",
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd", "/bin/bash", "--label", f"org.opencontainers.image.base.name=debian:{versions.DEBIAN_SUITE}",
                container)
        buildah("commit", "--quiet", container, ref)
    finally:
        buildah("rm", container)


def native_extension(root: Path = REPO_ROOT) -> Path:
    """The agent's data plane built on the host by cargo, cached by its sources and rustc's version.

    The host runs Debian bookworm like the base, so the extension links against the same glibc;
    it has its own target directory so that it never competes with ``make native``'s.
    """
    extra = {"rustc": _rustc_version(), **NATIVE_ENV}
    key = content_hash(root, collect_inputs(root, NATIVE_FILES, NATIVE_TREES), extra)[:12]
    extension = images_dir() / "native" / key / "_native.abi3.so"
    if extension.is_file():
        return extension
    target = images_dir() / "native" / "target"
    _run([_require("cargo", "cargo (rustup)"), "build", "--release", "--locked", "--quiet",
          "--manifest-path", str(root / "native" / "Cargo.toml"), "--target-dir", str(target)], env=NATIVE_ENV)
    extension.parent.mkdir(parents=True, exist_ok=True)
    partial = extension.with_suffix(".partial")
    shutil.copy2(target / "release" / "lib_native.so", partial)
    os.replace(partial, extension)
    return extension


def _rustc_version() -> str:
    return _run([_require("rustc", "rustc (rustup)"), "--version"]).strip()


def _project() -> tuple[Image, bool]:
    base = base_image()
    base_id = image_id(base) or ""
    files = project_inputs()
    extra = {"base": base_id, "native": f"prebuilt {_rustc_version()}", **NATIVE_ENV}
    tag = content_hash(REPO_ROOT, files, extra)[:12]
    ref = f"{PROJECT_REPOSITORY}:{tag}"
    image = Image(ref, archive_path(ref))
    cached = _ensure(image, lambda: _build_project(ref, base, files))
    if not cached:
        _drop_older(image)
    return image, cached


def _build_project(ref: str, base: str, files: list[str]) -> None:
    context = _stage_context(files, native_extension())
    secrets = [f"--secret=id=ca-certificates,src={bundle}" for bundle in [host_ca_bundle()] if bundle]
    log = buildah("bud", "--layers", "--force-rm", "--pull=never", "--isolation", "chroot", "--network", "host",
                  *secrets, "--build-arg", f"BASE={base}", "--build-arg", "NATIVE=prebuilt",
                  "-f", str(context / "Containerfile"), "-t", ref, str(context))
    _build_log(ref.rsplit(":", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    _build_log(ref.rsplit(":", 1)[1]).write_text(log)


def host_ca_bundle(environ: Mapping[str, str] = os.environ) -> str | None:
    """The CA bundle this host trusts for PyPI, handed to pip in the build as a secret.

    The base's ca-certificates only knows the public roots; a host behind a TLS-inspecting
    proxy trusts one more, named by pip's or OpenSSL's variables or added to the system bundle.
    """
    for candidate in (environ.get("PIP_CERT"), environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _stage_context(files: list[str], extension: Path) -> Path:
    """A build context holding exactly the hashed inputs plus the host-built extension.

    The repository itself would also offer .venv, native/target and __pycache__ to COPY;
    staging makes the image's content and its tag come from the same files.
    """
    context = images_dir() / "context"
    shutil.rmtree(context, ignore_errors=True)
    for relative in [*files, NATIVE_IN_CONTEXT]:
        source = extension if relative == NATIVE_IN_CONTEXT else REPO_ROOT / relative
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, context / relative)
    return context


def _drop_older(image: Image) -> None:
    """Forget all but the latest project images: their archives, tags and the layers only they used.

    With vfs every layer is a full copy of the filesystem, so each rebuild would add gigabytes.
    A few images are kept (checkouts that share this cache may alternate between trees); the
    layers their builds used (both stages, as each build's log names them) stay as the cache.
    """
    archives = sorted(images_dir().glob(f"{image.repository.rsplit('/', 1)[-1]}-*.oci.tar"),
                      key=lambda a: a.stat().st_mtime, reverse=True)
    for archive in archives[KEEP_PROJECT_IMAGES:]:
        archive.unlink(missing_ok=True)
        _build_log(archive.name.removesuffix(".oci.tar").rsplit("-", 1)[1]).unlink(missing_ok=True)
    kept = {f"{image.repository}:{a.name.removesuffix('.oci.tar').rsplit('-', 1)[1]}"
            for a in archives[:KEEP_PROJECT_IMAGES]} | {image.ref}
    logs = "".join(_build_log(ref.rsplit(":", 1)[1]).read_text()
                   for ref in kept if _build_log(ref.rsplit(":", 1)[1]).is_file())
    with _exclusive():
        listing = buildah("images", "--all", "--noheading", "--no-trunc", "--format", "{{.ID}}|{{.Name}}:{{.Tag}}")
        for target in stale_images(parse_listing(listing), image.repository, kept, logs):
            try:
                buildah("rmi", target)
            except BuildError as exc:  # gone with a removed child, or still in use: left for next time
                if "image not known" not in str(exc):
                    print(f"warning: {exc}", file=sys.stderr)


def _build_log(tag: str) -> Path:
    return images_dir() / "logs" / f"tailnet-operator-{tag}.log"


def parse_listing(listing: str) -> list[tuple[str, str]]:
    """(id without its ``sha256:``, name:tag) from ``buildah images --format '{{.ID}}|{{.Name}}:{{.Tag}}'``."""
    pairs = [line.split("|", 1) for line in listing.splitlines() if "|" in line]
    return [(i.strip().removeprefix("sha256:"), name.strip()) for i, name in pairs]


def stale_images(listing: Iterable[Sequence[str]], repository: str, kept: set[str], build_logs: str) -> list[str]:
    """What to remove from storage: tags of ``repository`` not in ``kept``, then every untagged
    image the kept builds' logs do not name (``--> <id>``, ``Using cache <id>``, ``FROM <id>``).

    ``listing`` holds (id, name:tag) pairs as ``buildah images --all`` prints them; other
    repositories' tags (the base, pause, CoreDNS) are never stale.
    """
    used = re.findall(r"(?:--> |Using cache |FROM )([0-9a-f]{11,64})\b", build_logs)
    stale: list[str] = []
    for image_id, name in listing:
        if name.startswith(repository + ":") and name not in kept:
            stale.append(name)
        elif name == "<none>:<none>" and not any(image_id.startswith(u) for u in used):
            stale.append(image_id)
    return stale


def project_image() -> Image:
    """The operator and agent image from Containerfile, tagged with the hash of what it copies."""
    return _project()[0]


def build_in_background(log: Path, *targets: str) -> subprocess.Popen[bytes]:
    """Start ``python -m hack.image build TARGETS`` in its own process group, its output in ``log``.

    A caller that needs the image later finds it cached, or waits on the build lock for this
    build to end: ``make run`` and the test session start the project's image this way while the
    binaries still build, so it is off their critical path. :func:`stop_background` ends it.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "hack.image", "build", *targets], cwd=REPO_ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_background(build: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stop a build of :func:`build_in_background` that is still running (and reap it)."""
    if build.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(build.pid, signal.SIGTERM)
        try:
            build.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(build.pid, signal.SIGKILL)
            build.wait()


# --- the real check -------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One command run inside the image, its expected exit code and a word its output must hold."""

    argv: tuple[str, ...]
    exit_code: int
    expect: str


_NO_BUILD_TOOLS = ("for t in gcc cc cargo rustc pip pip3 /opt/venv/bin/pip; do command -v $t && exit 1; done;"
                   " test ! -e /root/.cache/pip && echo clean")
"""Only the runtime stage ships: no compiler, no installer, no pip cache."""

_AGENT_IMPORTS = ("import tailnet_agent.control, tailnet_agent.node, tailnet_agent.health, tailnet_agent.forward,"
                  " tailnet_agent.forward.ingress, tailnet_agent.forward.http, tailnet_agent.status; print('imported')")
"""What both agent modes import lazily: `/tailnet-agent` without AGENT_MODE exits before any of it."""

SMOKE_CHECKS: dict[str, tuple[Check, ...]] = {
    PROJECT_REPOSITORY: (
        Check(("/tailnet-operator", "--version"), 0, "tailnet-operator "),
        Check(("/tailnet-agent",), 2, "AGENT_MODE"),
        Check(("/kubectl-tailnet", "--help"), 0, "status,diagnose,check"),
        Check(("/opt/venv/bin/python", "-c", "import tailnet_agent._native as n; print(n.__name__)"), 0, "_native"),
        Check(("/opt/venv/bin/python", "-c", _AGENT_IMPORTS), 0, "imported"),
        Check(("/usr/bin/id", "-u"), 0, NONROOT.split(":", 1)[0]),
        Check(("/bin/sh", "-c", _NO_BUILD_TOOLS), 0, "clean"),
    ),
    COREDNS_REPOSITORY: (Check(("/coredns", "-version"), 0, f"CoreDNS-{versions.COREDNS}"),),
}


def smoke(image: Image) -> None:
    """Check an exported image for real; raise BuildError on the first failure.

    The archive must be a complete OCI layout carrying ``image.ref``; then the image is created
    from the archive itself and its entry points are run (as the image's user) with buildah.
    The pause program is run on the host instead, since it must be stopped by a signal.
    """
    ref, config, _ = read_archive(image.archive)
    if ref != image.ref:
        raise BuildError(f"{image.archive} carries {ref!r}, not {image.ref!r}")
    user = config.get("config", {}).get("User", "")
    if user in ("", "0", "root") or user.startswith(("0:", "root")):
        raise BuildError(f"{image.ref} runs as root")
    if image.repository == PAUSE_REPOSITORY:
        _smoke_pause(image.archive)
        return
    with _exclusive():
        container = buildah("from", "--quiet", f"oci-archive:{image.archive}").strip()
        try:
            for check in SMOKE_CHECKS.get(image.repository, ()):
                _run_check(container, check)
        finally:
            buildah("rm", container)


def _run_check(container: str, check: Check) -> None:
    cmd = _buildah_argv("run", "--isolation", "chroot", "--network", "host", container, "--", *check.argv)
    with _host_left_clean():
        proc = subprocess.run(cmd, env={**os.environ, **_buildah_env()}, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    if proc.returncode != check.exit_code or check.expect not in output:
        raise BuildError(f"{' '.join(check.argv)}: exit {proc.returncode} (want {check.exit_code}),"
                         f" output without {check.expect!r}:\n{output[-2000:]}")


def _smoke_pause(archive: Path) -> None:
    """Run the archive's /pause on the host: it must wait, then exit 0 on SIGTERM."""
    with tempfile.TemporaryDirectory(dir=images_dir()) as tmp:
        program = Path(tmp) / "pause"
        program.write_bytes(_file_from_archive(archive, "pause"))
        program.chmod(0o755)
        with subprocess.Popen([str(program)]) as proc:
            time.sleep(0.3)
            if proc.poll() is not None:
                raise BuildError(f"pause exited early with {proc.returncode}")
            proc.send_signal(signal.SIGTERM)
            if proc.wait(timeout=10) != 0:
                raise BuildError(f"pause exited with {proc.returncode} on SIGTERM")


def _file_from_archive(archive: Path, name: str) -> bytes:
    """The content of ``name`` (a path inside the image) from the archive's layers."""
    _, _, layers = read_archive(archive)
    with tarfile.open(archive) as outer:
        for digest in reversed(layers):
            blob = outer.extractfile(_blob(digest))
            data = _member(blob, name) if blob is not None else None
            if data is not None:
                return data
    raise BuildError(f"{archive}: no {name} in any layer")


def _member(layer: IO[bytes], name: str) -> bytes | None:
    with tarfile.open(fileobj=layer, mode="r:*") as tar:
        for member in tar:
            if member.isfile() and member.name.lstrip("./") == name:
                extracted = tar.extractfile(member)
                return extracted.read() if extracted is not None else None
    return None


# --- command line ---------------------------------------------------------------------------

_TARGETS: dict[str, Callable[[], tuple[Image, bool]]] = {"pause": _pause, "coredns": _coredns, "project": _project}


def _build_base() -> tuple[Image, bool]:
    cached = image_id(f"{BASE_REPOSITORY}:{base_tag(versions.DEBIAN_SUITE, BASE_PACKAGES)}") is not None
    ref = base_image()
    return Image(ref, images_dir() / "base" / f"{ref.rsplit(':', 1)[1]}.tar"), cached


def main(argv: list[str]) -> int:
    command, names = (argv[0], argv[1:]) if argv else ("build", [])
    targets = {**_TARGETS, "base": _build_base}
    if command not in ("build", "smoke") or not set(names) <= {*targets, "all"}:
        print("usage: python -m hack.image [build|smoke] [project|pause|coredns|base|all]...", file=sys.stderr)
        return 2
    selected = list(_TARGETS) if not names or "all" in names else names
    try:
        _require_root()
        for name in selected:
            started = time.monotonic()
            image, cached = targets[name]()
            print(f"{name:8} {'cached' if cached else 'built':6} {time.monotonic() - started:7.1f}s"
                  f"  {image.ref}  {image.archive}", flush=True)
            if command == "smoke" and name != "base":
                started = time.monotonic()
                smoke(image)
                print(f"{name:8} smoke  {time.monotonic() - started:7.1f}s  ok", flush=True)
    except (MissingToolError, BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
