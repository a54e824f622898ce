"""``python -m hack.kind up|down|e2e|run|node-image|status``: `make e2e` and its steps.

``e2e`` runs ``up``, the ``cluster`` tests against the kind cluster, and ``down`` whatever
happened; ``run -- COMMAND`` does the same with any command (a benchmark that measures on kind);
``up`` leaves the cluster (and our dockerd) running until ``down``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from hack import binaries

from . import cluster, docker, nodeimage, plan


def kubeconfig_path() -> Path:
    return docker.docker_root() / f"{plan.CLUSTER_NAME}.kubeconfig"


def up() -> dict[str, float]:
    """dockerd, the network, the node image, the cluster, its wiring; returns timings."""
    timings: dict[str, float] = {}
    state = docker.state_file()
    docker.docker_root().mkdir(parents=True, exist_ok=True)
    if docker.HostState.load(state) is None:
        docker.HostState.capture().save(state)
    started = time.monotonic()
    docker.start_daemon()
    docker.ensure_network()
    docker.add_guard()
    timings["dockerd"] = time.monotonic() - started
    started = time.monotonic()
    node = nodeimage.ensure_node_image()
    timings["node image"] = time.monotonic() - started
    print(f"kind: node image {node.ref} ({timings['node image']:.0f}s)", flush=True)
    workdir = docker.docker_root()
    if not cluster.exists():
        timings["kind create"] = cluster.create(kubeconfig_path(), workdir)
        print(f"kind: cluster created in {timings['kind create']:.0f}s", flush=True)
    started = time.monotonic()
    cluster.wire(kubeconfig_path())
    cluster.wait_ready(kubeconfig_path())
    timings["ready"] = time.monotonic() - started
    print(f"kind: nodes and kube-system Ready {timings['ready']:.0f}s later; kubeconfig {kubeconfig_path()}",
          flush=True)
    return timings


def down() -> list[str]:
    """Delete the cluster, stop dockerd, remove routes and the guard, restore the host; return
    what is still left (empty when clean)."""
    if docker.daemon_pid() is not None:
        try:
            cluster.delete()
        except RuntimeError as exc:
            print(f"kind: {exc}", file=sys.stderr)
    docker.stop_daemon()
    docker.remove_routes()
    docker.remove_guard()
    state = docker.HostState.load(docker.state_file())
    if state is not None:
        for change in state.restore():
            print(f"kind: {change}")
        docker.state_file().unlink()
    kubeconfig_path().unlink(missing_ok=True)
    left = docker.leftovers()
    for item in left:
        print(f"kind: left behind: {item}", file=sys.stderr)
    return left


def e2e(pytest_args: list[str]) -> int:
    """``up``, the cluster tests, ``down``: the exit status is the tests' (or 1 when set-up or
    teardown failed)."""
    return run([sys.executable, "-m", "pytest", "e2e", "-m", "cluster", *pytest_args], what="cluster tests")


def run(command: list[str], *, what: str = "command") -> int:
    """``up``, ``command`` against the kind cluster (its kubeconfig, name and host address in the
    variables the cluster tests and benchmarks read), ``down``: the exit status is the command's
    (or 1 when set-up or teardown failed)."""
    status = 1
    try:
        up()
        env = docker.environment()
        env.update({
            "TAILNET_E2E_KUBECONFIG": str(kubeconfig_path()),
            "TAILNET_E2E_KIND_NAME": plan.CLUSTER_NAME,
            "TAILNET_E2E_HOST_ADDRESS": docker.network_gateway(),
        })
        started = time.monotonic()
        status = subprocess.run(command, env=env, check=False).returncode
        print(f"kind: {what} exited {status} after {time.monotonic() - started:.0f}s", flush=True)
    finally:
        if os.environ.get("TAILNET_KIND_KEEP") != "1" and down():
            status = status or 1
    return status


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hack.kind")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    sub.add_parser("node-image")
    sub.add_parser("status")
    sub.add_parser("e2e", help="up, the cluster tests (further arguments go to pytest), down")
    sub.add_parser("run", help="up, the command after `--` against the cluster (e.g. a benchmark), down")
    args, pytest_args = parser.parse_known_args(argv)
    if pytest_args and args.command not in ("e2e", "run"):
        parser.error(f"unrecognized arguments: {' '.join(pytest_args)}")
    if os.geteuid() != 0:
        print("kind: make e2e starts its own dockerd and needs root", file=sys.stderr)
        return 1
    try:
        if args.command == "up":
            up()
        elif args.command == "down":
            return 1 if down() else 0
        elif args.command == "node-image":
            with docker.running_daemon():
                print(nodeimage.ensure_node_image().ref)
        elif args.command == "status":
            print("\n".join(docker.leftovers()) or "nothing of make e2e is on this machine")
        elif args.command == "run":
            command = pytest_args[1:] if pytest_args[:1] == ["--"] else pytest_args
            if not command:
                parser.error("run: give the command after --")
            return run(command)
        else:
            return e2e([a for a in pytest_args if a != "--"])
    except binaries.MissingToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
