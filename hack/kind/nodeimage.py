"""kind's node image, built here without a registry, cached by content in our dockerd's storage.

``kind build node-image`` fetches every image that is not in its four Kubernetes tarballs from a
registry, unconditionally (../shared/reference/kind-offline.md), so this does by hand what its
builder does:

1. the base: a debootstrap rootfs with kind's packages (bookworm: systemd 252 still runs on
   cgroup v1), kind's own files from the pinned module (entrypoint, units, mount helpers), the
   pinned containerd, runc and CNI plugins, our CNI unit and containerd configuration,
   ``docker import``-ed with kind's entrypoint;
2. the node: kubeadm, kubelet and kubectl in /usr/bin, and the control-plane images (each a
   static binary, built with ``docker build``), etcd, CoreDNS and the pause image imported into
   the node's containerd by a throwaway container of the base, then ``docker commit``.

Each image's tag is a hash of its inputs, so a second run finds it and builds nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hack import binaries, image, versions

from . import docker, plan

CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE_BINARIES = ("kubeadm", "kubelet", "kubectl")
CNI_BINARIES = ("host-local", "loopback", "portmap", "ptp")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _run(cmd: list[str], *, cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-3000:]}")
    return proc.stdout


def image_exists(ref: str) -> bool:
    return docker.docker("image", "inspect", ref, check=False).returncode == 0


def kind_module() -> Path:
    return binaries.module_dir("sigs.k8s.io/kind", versions.KIND)


# --- the base -------------------------------------------------------------------------------


def base_binaries() -> dict[str, Path]:
    """Destination in the rootfs -> the cached binary."""
    files = {f"/usr/local/bin/{b}": binaries.binary(b) for b in ("containerd", "containerd-shim-runc-v2", "ctr")}
    files["/usr/local/sbin/runc"] = binaries.binary("runc")
    files.update({f"/opt/cni/bin/{b}": binaries.binary(b) for b in CNI_BINARIES})
    return files


def base_generated() -> dict[str, str]:
    """Files we write into the base (path -> text)."""
    return {
        plan.NET_SCRIPT: plan.net_script(),
        "/etc/systemd/system/tailnet-kind-net.service": plan.net_unit(),
        "/etc/containerd/config.toml": plan.containerd_config(sandbox_ref()),
    }


def sandbox_ref() -> str:
    return image.pause_image().ref


def base_ref() -> str:
    parts = {f"bin {k}": _sha256(v) for k, v in base_binaries().items()}
    parts.update({f"file {k}": hashlib.sha256(v.encode()).hexdigest() for k, v in base_generated().items()})
    parts["rootfs"] = rootfs_tag()
    parts["kind"] = versions.KIND
    parts["changes"] = "\n".join(plan.NODE_CHANGES)
    parts["recipe"] = "1"
    return f"{plan.BASE_IMAGE_REPOSITORY}:{plan.content_tag(parts)}"


def rootfs_tag() -> str:
    return image.base_tag(versions.DEBIAN_SUITE, plan.BASE_PACKAGES)


def rootfs_tarball() -> Path:
    """The debootstrapped rootfs with kind's packages, cached as a tarball."""
    return image.rootfs_tarball(image.images_dir() / "kind-base" / f"{rootfs_tag()}.tar", plan.BASE_PACKAGES)


def _trim_systemd(rootfs: Path) -> None:
    """What kind's base Dockerfile removes from systemd: the units a container must not run."""
    (rootfs / "usr/lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service").unlink(missing_ok=True)
    units = "usr/lib/systemd/system"
    for pattern in (f"{units}/multi-user.target.wants/*", "etc/systemd/system/*.wants/*",
                    f"{units}/local-fs.target.wants/*", f"{units}/sockets.target.wants/*udev*",
                    f"{units}/sockets.target.wants/*initctl*", f"{units}/basic.target.wants/*"):
        for path in rootfs.glob(pattern):
            path.unlink()
    with (rootfs / "etc/systemd/journald.conf").open("a") as f:
        f.write("ReadKMsg=no\n")
    init = rootfs / "sbin/init"
    if init.is_symlink() or init.exists():
        init.unlink()
    init.symlink_to("/usr/lib/systemd/systemd")


def _install(rootfs: Path, destination: str, source: Path | None = None, text: str | None = None,
             mode: int = 0o755) -> None:
    target = rootfs / destination.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if source is not None:
        shutil.copyfile(source, target)
    else:
        target.write_text(text or "")
    target.chmod(mode)


def _assemble_base(rootfs: Path) -> None:
    _trim_systemd(rootfs)
    files = kind_module() / "images" / "base" / "files"
    for relative in plan.KIND_FILES:
        source = files / relative
        if source.is_dir():
            for path in source.rglob("*"):
                if path.is_file():
                    mode = 0o755 if "bin" in path.relative_to(files).parts else 0o644
                    _install(rootfs, str(path.relative_to(files)), source=path, mode=mode)
        elif source.is_file():
            _install(rootfs, relative, source=source, mode=0o644)
    for destination, source in base_binaries().items():
        _install(rootfs, destination, source=source)
    for destination, text in base_generated().items():
        _install(rootfs, destination, text=text, mode=0o755 if destination.endswith(".sh") else 0o644)
    spec = json.loads(_run([str(binaries.binary("ctr")), "oci", "spec"]))
    _install(rootfs, "/etc/containerd/cri-base.json", text=json.dumps(plan.cri_base_spec(spec), indent=1),
             mode=0o644)
    wants = rootfs / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    for unit in plan.ENABLED_UNITS:
        (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")
    for unit in plan.MASKED_UNITS:
        masked = rootfs / "etc/systemd/system" / unit
        masked.unlink(missing_ok=True)
        masked.symlink_to("/dev/null")
    for directory in ("etc/kubernetes/manifests", "kind", "var/lib/containerd"):
        (rootfs / directory).mkdir(parents=True, exist_ok=True)


def ensure_base() -> str:
    """The base image (ref), imported unless our dockerd has it."""
    ref = base_ref()
    if image_exists(ref):
        return ref
    tarball = rootfs_tarball()
    with tempfile.TemporaryDirectory(dir=docker.docker_root()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        _run(["tar", "--numeric-owner", "--xattrs", "-xf", str(tarball), "-C", str(rootfs)])
        _assemble_base(rootfs)
        archive = Path(tmp) / "rootfs.tar"
        _run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(archive), "."])
        changes = [arg for change in plan.NODE_CHANGES for arg in ("--change", change)]
        docker.docker("import", *changes, str(archive), ref, timeout=1200)
    return ref


# --- the images in the node -----------------------------------------------------------------


@dataclass(frozen=True)
class NodeImage:
    ref: str
    images: tuple[str, ...]
    """What the node's containerd holds (references)."""


def _kubernetes_tag() -> str:
    return f"v{versions.KUBERNETES}"


def _docker_build(ref: str, dockerfile: str, files: Mapping[str, Path]) -> None:
    with tempfile.TemporaryDirectory(dir=docker.docker_root()) as tmp:
        context = Path(tmp)
        for name, source in files.items():
            shutil.copyfile(source, context / name)
            (context / name).chmod(0o755)
        (context / "Dockerfile").write_text(dockerfile)
        docker.docker("build", "--quiet", "--network=none", "-t", ref, str(context), timeout=1200)


def control_plane_images(base: str) -> dict[str, str]:
    """Build (unless present) kube-apiserver, -controller-manager, -scheduler, kube-proxy and etcd
    as docker images; return ref -> how to make it (for the node image's hash)."""
    made: dict[str, str] = {}
    for name in (*CONTROL_PLANE, "kube-proxy", "etcd"):
        tag = versions.ETCD if name == "etcd" else _kubernetes_tag()
        path = binaries.binary(name)
        # kube-proxy runs nft and iptables: it sits on the base (Debian with both), the rest on scratch.
        dockerfile = plan.scratch_dockerfile(name, base=base if name == "kube-proxy" else "scratch")
        ref = plan.image_ref(name, f"{tag}")
        recipe = f"{dockerfile}\n{_sha256(path)}"
        if not image_exists(ref) or _label(ref) != hashlib.sha256(recipe.encode()).hexdigest()[:12]:
            labelled = dockerfile + f'LABEL dev.tailnet.recipe="{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"\n'
            _docker_build(ref, labelled, {name: path})
        made[ref] = recipe
    return made


def _label(ref: str) -> str:
    out = docker.docker("image", "inspect", "--format", '{{index .Config.Labels "dev.tailnet.recipe"}}', ref,
                        check=False).stdout.strip()
    return out


def ensure_node_image() -> NodeImage:
    """The node image (built unless our dockerd has its content tag)."""
    base = ensure_base()
    built = control_plane_images(base)
    archives = {image.pause_image().ref: image.pause_image().archive,
                image.coredns_image().ref: image.coredns_image().archive}
    parts = {"base": base, **{f"image {k}": v for k, v in built.items()},
             **{f"archive {k}": _sha256(v) for k, v in archives.items()},
             **{f"bin {b}": _sha256(binaries.binary(b)) for b in NODE_BINARIES},
             "version": versions.KUBERNETES, "recipe": "1"}
    ref = f"{plan.NODE_IMAGE_REPOSITORY}:v{versions.KUBERNETES}-{plan.content_tag(parts)}"
    images = (*built, *archives)
    if image_exists(ref):
        return NodeImage(ref, images)
    started = time.monotonic()
    name = f"tailnet-kind-build-{os.getpid()}"
    docker.docker("run", "-d", "--name", name, "--privileged", "--network=none", "--entrypoint=sleep", base,
                  "infinity")
    try:
        with tempfile.TemporaryDirectory(dir=docker.docker_root()) as tmp:
            staging = Path(tmp)
            for binary in NODE_BINARIES:
                shutil.copyfile(binaries.binary(binary), staging / binary)
                (staging / binary).chmod(0o755)
                docker.docker("cp", str(staging / binary), f"{name}:/usr/bin/{binary}")
            (staging / "version").write_text(f"v{versions.KUBERNETES}\n")
            docker.docker("cp", str(staging / "version"), f"{name}:/kind/version")
            docker.docker("exec", name, "mkdir", "-p", "/kind/images")
            tars: dict[str, Path] = {}
            for ref_ in built:
                tar = staging / f"{len(tars)}.tar"
                docker.docker("save", "-o", str(tar), ref_, timeout=1200)
                tars[ref_] = tar
            for ref_, archive in archives.items():
                tars[ref_] = archive
            exec_ = ["exec", name]
            docker.docker(*exec_, "sh", "-c", "mkdir -p /run/containerd && (containerd >/tmp/containerd.log 2>&1 &)")
            _wait_containerd(name)
            for i, tar in enumerate(tars.values()):
                docker.docker("cp", str(tar), f"{name}:/kind/images/{i}.tar", timeout=1200)
                docker.docker(*exec_, "ctr", "-n", "k8s.io", "images", "import", "--all-platforms", "--no-unpack",
                              "--digests", "--label", "io.cri-containerd.pinned=pinned", f"/kind/images/{i}.tar",
                              timeout=1200)
                docker.docker(*exec_, "rm", f"/kind/images/{i}.tar")
            listed = docker.docker(*exec_, "ctr", "-n", "k8s.io", "images", "list", "-q").stdout.split()
            missing = [r for r in images if not any(line == r or line.endswith("/" + r) for line in listed)]
            if missing:
                raise RuntimeError(f"images missing from the node's containerd after import: {missing}; has {listed}")
            docker.docker(*exec_, "sh", "-c", "pkill containerd; sleep 1; rm -rf /run/containerd /tmp/containerd.log")
        docker.docker("stop", "-t", "1", name)
        changes = [arg for change in plan.NODE_CHANGES for arg in ("--change", change)]
        committed = docker.docker("commit", *changes, name, timeout=1200).stdout.strip()
        _docker_build(ref, f"FROM {committed}\nSTOPSIGNAL {plan.STOP_SIGNAL}\n", {})
        docker.docker("rmi", committed, check=False)
    finally:
        docker.docker("rm", "-f", name, check=False)
    print(f"kind: node image {ref} built in {time.monotonic() - started:.0f}s")
    prune_except(plan.NODE_IMAGE_REPOSITORY, ref)
    prune_except(plan.BASE_IMAGE_REPOSITORY, base)
    docker.docker("image", "prune", "-f", check=False)  # untagged: control-plane images of an earlier base
    return NodeImage(ref, images)


def prune_except(repository: str, keep: str) -> None:
    """Remove the other tags of ``repository`` (images of earlier inputs), so the cache keeps one
    node image and one base."""
    tags = docker.docker("images", "--format", "{{.Repository}}:{{.Tag}}", repository).stdout.split()
    stale = [t for t in tags if t != keep]
    if stale:
        docker.docker("rmi", *stale, check=False)


def _wait_containerd(name: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if docker.docker("exec", name, "ctr", "version", check=False).returncode == 0:
            return
        time.sleep(0.5)
    log = docker.docker("exec", name, "cat", "/tmp/containerd.log", check=False).stdout
    raise RuntimeError(f"containerd did not start in the build container: {log[-2000:]}")
