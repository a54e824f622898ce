"""The local environment itself: real tailscaled nodes on a real Headscale, real namespaces."""

from __future__ import annotations

import http.server
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hack.localenv import (
    BASE_DOMAIN,
    Environment,
    Headscale,
    ManagedProcess,
    SiteHost,
    free_port,
    marked_processes,
    netns_available,
    wait_until,
)

from .conftest import TailscaleFactory

pytestmark = pytest.mark.integration


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        port = self.server.server_address[1]  # type: ignore[index]
        body = f"hello from {port} path {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def local_http_server() -> Iterator[int]:
    """An HTTP server on 127.0.0.1 (the 'other side' of a userspace tailscaled)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _get_via(proxy: str, url: str, timeout: float = 5.0) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy}))
    with opener.open(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def test_two_nodes_join_see_each_other_and_carry_tcp(
    headscale: Headscale, tailscale_nodes: TailscaleFactory, local_http_server: int
) -> None:
    user = headscale.create_user("env-test")
    key = headscale.create_preauth_key(user_id=user["id"], reusable=True)
    client = tailscale_nodes("client", headscale, authkey=key)
    server = tailscale_nodes("server", headscale, authkey=key, advertise_routes=["198.18.250.0/24"])

    wait_until(lambda: client.sees("server") and server.sees("client"), timeout=30,
               what="the two nodes to see each other")
    url = f"http://{server.ipv4()}:{local_http_server}/over-the-tailnet"
    body = wait_until(lambda: _get_via(client.http_proxy, url), timeout=30,
                      what=f"GET {url} through the client's tailnet proxy")
    assert body == f"hello from {local_http_server} path /over-the-tailnet"

    names = sorted(n["givenName"] for n in headscale.nodes())
    assert names == ["client", "server"]
    server_node = headscale.node_by_name("server")
    assert server_node is not None
    assert "198.18.250.0/24" in server_node.get("availableRoutes", [])
    assert "198.18.250.0/24" not in server_node.get("approvedRoutes", [])


def test_approved_subnet_route_reaches_a_host_in_a_namespace(
    headscale: Headscale, tailscale_nodes: TailscaleFactory, site_host: Callable[[], SiteHost]
) -> None:
    host = site_host()
    host.serve_http(8080)
    user = headscale.create_user("site-test")
    key = headscale.create_preauth_key(user_id=user["id"], reusable=True)
    tailscale_nodes("router", headscale, authkey=key, advertise_routes=[host.subnet], site_router=True)
    client = tailscale_nodes("laptop", headscale, authkey=key, accept_routes=True)
    url = f"http://{host.address}:8080/"

    with pytest.raises(OSError):
        _get_via(client.http_proxy, url, timeout=3)  # not approved yet: no route on the tailnet

    node = headscale.node_by_name("router")
    assert node is not None
    approved = headscale.approve_routes(node["id"], [host.subnet])
    assert host.subnet in approved["approvedRoutes"]
    body = wait_until(lambda: _get_via(client.http_proxy, url), timeout=30,
                      what=f"GET {url} through the subnet router")
    assert body == f"hello from {host.address}:8080 path /\n"


def test_a_run_directory_deeper_than_a_unix_socket_path_allows_still_runs_nodes(tmp_path: Path) -> None:
    """A checkout deep in the file system (CI's ``/check/work/main``) puts the run directory past
    the 107 bytes a unix socket's path may have; Headscale and tailscaled still start and join."""
    deep = tmp_path / ("deep-" * 12) / "run"
    env = Environment(deep, run_id="deep-run-selftest")
    try:
        assert len(bytes(deep / "tailscale-a-hostname-as-long-as-a-conformance-laptop" / "tailscaled.sock")) > 107
        headscale = env.headscale("headscale-deep-checkout")
        key = headscale.create_preauth_key(user_id=headscale.create_user("deep")["id"])
        node = env.tailscale_node("a-hostname-as-long-as-a-conformance-laptop", headscale, authkey=key)
        assert node.status()["BackendState"] == "Running"
        assert headscale.node_by_name("a-hostname-as-long-as-a-conformance-laptop") is not None
    finally:
        env.close()
    assert env.survivors() == []


def test_a_name_no_node_carries_is_never_looked_up_outside_the_machine(
    headscale: Headscale, tailscale_nodes: TailscaleFactory
) -> None:
    """A laptop asked for a tailnet name its netmap lacks (one not given yet, or between the two
    renames of a hand-over) falls back to a resolver: it must be none outside this machine."""
    if os.geteuid() != 0:
        pytest.skip("a node's own resolver needs a mount namespace: root")
    key = headscale.create_preauth_key(user_id=headscale.create_user("resolver")["id"])
    laptop = tailscale_nodes("resolver-laptop", headscale, authkey=key)
    name = f"nobody.{BASE_DOMAIN}"
    with socket.create_connection(("127.0.0.1", laptop.http_proxy_port), timeout=30) as conn:
        conn.sendall(f"CONNECT {name}:80 HTTP/1.1\r\nHost: {name}:80\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := conn.recv(4096)):
            answer += chunk
    head = answer.decode(errors="replace")
    assert " 500 " in head.split("\r\n", 1)[0], head
    error = next(line for line in head.split("\r\n") if line.startswith("Tailscale-Connect-Error:"))
    servers = re.findall(r" on \[?([0-9a-f.:]+?)\]?:53\b", error)
    assert servers, error
    assert all(ipaddress.ip_address(server).is_loopback for server in servers), error


def test_a_host_on_the_tailnet_reaches_a_nodes_address_directly(tmp_path: Path, local_http_server: int) -> None:
    """A tailscaled on a TUN device in a reachable host's namespace: what runs there dials a tailnet
    address with no proxy, as a tailnet user's machine does (the conformance suite's TLS tests)."""
    if (reason := netns_available()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    env = Environment(tmp_path / "run", run_id="tailnet-host-selftest")
    try:
        host = env.site_host(reachable=True)
        headscale = env.headscale(address=host.gateway)
        key = headscale.create_preauth_key(user_id=headscale.create_user("tun")["id"], reusable=True)
        server = env.tailscale_node("tun-server", headscale, authkey=key)
        client = env.tailscale_node("tun-client", headscale, authkey=key, host=host)
        wait_until(lambda: client.sees("tun-server"), timeout=30, what="the namespaced node sees the server")
        url = f"http://{server.ipv4()}:{local_http_server}/direct"
        fetch = ["ip", "netns", "exec", host.name, sys.executable, "-c",
                 f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"]

        def answered() -> str | None:
            done = subprocess.run(fetch, capture_output=True, text=True, timeout=30)
            return done.stdout.strip() if done.returncode == 0 else None

        body = wait_until(answered, timeout=60, interval=1.0, what=f"GET {url} from the namespace")
        assert body == f"hello from {local_http_server} path /direct"
        assert Path(f"/etc/netns/{host.name}/resolv.conf").is_file()
    finally:
        env.close()
    assert env.survivors() == []
    assert not Path(f"/etc/netns/{host.name}").exists()


def test_leak_check_finds_a_running_process_and_not_a_stopped_one(tmp_path: Path) -> None:
    env = Environment(tmp_path, run_id="leakcheck-selftest")
    proc = ManagedProcess("sleeper", ["sleep", "300"], log_dir=env.log_dir, run_id=env.run_id)
    proc.start()
    try:
        # The marker is in the environment from exec on: poll, the fork may not have exec'd yet.
        assert wait_until(lambda: [pid for pid, _ in marked_processes(env.run_id)] == [proc.pid], timeout=10,
                          what="the sleeper to carry the run marker")
    finally:
        proc.stop()
    assert list(marked_processes(env.run_id)) == []


def test_stopping_a_process_long_gone_spares_the_process_that_took_its_number(tmp_path: Path) -> None:
    """Once a process has exited and been reaped, and its group is empty, the kernel hands its
    number out again; a stop then must not signal whatever group that number names now (the
    local part's teardown once killed the node part's kubectl and tailscaled this way)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: it hands a number out again through /proc/sys/kernel/ns_last_pid")
    env = Environment(tmp_path, run_id="reused-number-selftest")
    gone = ManagedProcess("gone", ["true"], log_dir=env.log_dir, run_id=env.run_id)
    gone.start()
    wait_until(lambda: not gone.running(), timeout=10, what="the short-lived process to exit")
    assert gone.pid is not None
    stranger = _start_with_pid(gone.pid, ["sleep", "300"])
    try:
        gone.stop()
    finally:
        stranger.terminate()
        code = stranger.wait(10)
    # A SIGKILL sent by the stop is pending before the stop returns, and it wins over the SIGTERM.
    assert code == -signal.SIGTERM, f"the stop of a process long gone killed pid {stranger.pid} (exit {code})"


def test_stopping_a_process_kills_what_it_left_running_in_its_group(tmp_path: Path) -> None:
    env = Environment(tmp_path, run_id="orphans-selftest")
    parent = ManagedProcess("parent", ["sh", "-c", "sleep 300 & echo $! > child.pid"], log_dir=env.log_dir,
                            run_id=env.run_id, cwd=tmp_path)
    parent.start()
    child_pid = int(wait_until(lambda: (tmp_path / "child.pid").read_text().strip() or None, timeout=10,
                               what="the child's pid"))
    wait_until(lambda: not parent.running(), timeout=10, what="the parent to exit before its child")
    assert child_pid in [pid for pid, _ in marked_processes(env.run_id)], "the child outlived its parent"
    parent.stop()
    assert wait_until(lambda: [pid for pid, _ in marked_processes(env.run_id)] == [], timeout=10,
                      what="the orphaned child to be killed")


def _start_with_pid(pid: int, argv: list[str], attempts: int = 200) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own under process number ``pid`` (free again), as the
    kernel does once the numbers wrap; other forks on the machine may take it first, so retry."""
    for _ in range(attempts):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(argv, start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait(10)
    pytest.fail(f"could not start a process under the free number {pid} in {attempts} attempts")


def test_free_ports_stay_out_of_the_kernels_ephemeral_range() -> None:
    """Outgoing connections take ports from the ephemeral range; a port handed to a server that
    binds it later must not be one of those."""
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "each port is handed out once"
    assert all(10000 <= p < low for p in ports), (min(ports), max(ports), low)


def test_site_hosts_that_start_from_one_subnet_each_claim_their_own(tmp_path: Path) -> None:
    """Test processes run side by side (``hack.suite``) and each numbers its hosts from its pid:
    two hosts whose first choice is the same /24 must end on different ones."""
    if (reason := netns_available()) is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    hosts = [SiteHost(log_dir=tmp_path, run_id="subnet-selftest") for _ in range(2)]
    for host in hosts:
        host._first_octet = hosts[0]._first_octet
    try:
        for host in hosts:
            host.create()
        assert hosts[0].subnet != hosts[1].subnet
        assert all(host.subnet.startswith("198.18.") for host in hosts)
    finally:
        for host in hosts:
            host.destroy()


def test_a_tailnet_address_no_peer_has_is_never_dialled_through_this_machines_network(
    headscale: Headscale, tailscale_nodes: TailscaleFactory
) -> None:
    """A userspace tailscaled proxies an address outside its netmap through the host's network: a
    test that asks a laptop for a node that has not joined yet would send that packet out of the
    machine. The environment's guard (an unreachable route over the tailnet's ranges) makes the
    laptop refuse it here instead."""
    from hack.localenv.tailnet_guard import TAILNET_RANGES, route_present

    if os.geteuid() != 0:
        pytest.skip("the guard's route needs root")
    user = headscale.create_user("guard-test")
    laptop = tailscale_nodes("guard-laptop", headscale, authkey=headscale.create_preauth_key(user_id=user["id"]))
    assert all(route_present(cidr) for cidr in TAILNET_RANGES)
    with pytest.raises(OSError) as refused:  # urllib's HTTPError is an OSError: the proxy's 502
        _get_via(laptop.http_proxy, "http://100.127.255.254:80/never", timeout=10)
    assert "502" in str(refused.value) or "unreachable" in str(refused.value).lower(), refused.value
