"""Child processes that are always stopped, and the small waiting helpers around them.

Every process the local environment starts carries ``TAILNET_LOCALENV_RUN=<run id>`` in its
environment, so a leak check can find any survivor by scanning ``/proc`` without trusting
our own bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TypeVar

RUN_MARKER = "TAILNET_LOCALENV_RUN"

T = TypeVar("T")


class EnvironmentStartError(RuntimeError):
    """A component did not come up; the message names its log file."""


LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it picks itself (outgoing connections, ``bind(0)``)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _free_both_ways(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing uses right now for TCP or UDP, for a server to bind soon.

    Chosen below the kernel's ephemeral range: a port from that range can be taken by any
    outgoing connection between this check and the server's bind (a real failure seen in the test
    run: Headscale could not bind). A port is handed out once per process.
    """
    low, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(LOWEST_PORT, max(low, LOWEST_PORT + 1000))
        if port not in _handed_out and _free_both_ways(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port between {LOWEST_PORT} and {low}")


SUN_PATH_MAX = 107


def socket_dir(prefix: str, *, owner: int | None = None) -> Path:
    """A new, private directory in the system's temporary directory for unix sockets.

    A socket's path may be at most ``SUN_PATH_MAX`` bytes, and a run directory inside a deep
    checkout is longer than that (a real failure: tailscaled could not create its socket under
    ``/check/work/main/_artifacts/...``). The caller removes the directory when it stops.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def wait_until(condition: Callable[[], T | None], *, timeout: float, interval: float = 0.1,
               what: str = "condition") -> T:
    """Poll ``condition`` until it returns a truthy value, or fail after ``timeout`` seconds.

    Exceptions raised by ``condition`` count as "not yet"; the last one is chained.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = condition()
            if result:
                return result
        except Exception as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}") from last_error
        time.sleep(interval)


class ManagedProcess:
    """One child process with its own log file, stopped with SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: Sequence[str | os.PathLike[str]], *, log_dir: Path,
                 run_id: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                 user: int | None = None, group: int | None = None) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_dir / f"{name}.log"
        self._run_id = run_id
        self._env = {**os.environ, **(env or {}), RUN_MARKER: run_id}
        self._cwd = cwd
        self._user = user
        self._group = group if group is not None else user
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log.write(f"--- start: {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self._env, cwd=self._cwd, start_new_session=True,
            user=self._user, group=self._group,
        )

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def check_running(self) -> None:
        """Raise with the tail of the log when the process has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            raise EnvironmentStartError(
                f"{self.name} exited with code {self._proc.returncode}; log: {self.log_path}\n"
                + self.log_tail()
            )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the whole process group; idempotent.

        The group is signalled by its number only while its leader is unreaped, so the number is
        still ours. Children that outlive the leader are found by group and run marker instead:
        once the group is empty, the kernel hands the number to an unrelated process, and a
        ``killpg`` then kills that process's group."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        if proc is not None:
            for pid in group_members(proc.pid, self._run_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """Kill at once, as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(self._proc, signal.SIGKILL)
            self._proc.wait(5)

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def group_members(group: int, run_id: str) -> list[int]:
    """Processes of run ``run_id`` in process group ``group``."""
    members = []
    for pid, _ in marked_processes(run_id):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == group:  # state, ppid, pgrp
            members.append(pid)
    return members


def marked_processes(run_id: str) -> Iterator[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries ``run_id``."""
    needle = f"{RUN_MARKER}={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            if needle not in environ.split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(entry.name), cmdline.strip()
