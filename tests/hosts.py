"""Hosts for the tests: network namespaces on this machine, each with its own address.

``Hosts(n)`` makes ``n`` hosts joined by one switch: a namespace per host holding the
loopback and an interface ``IFNAME`` with address ``10.77.0.(i+1)/24``, and one more
namespace holding a bridge with one port per host (the root namespace is left as it is).
A command runs on host ``i`` through ``ip netns exec``; it sees only that host's
interfaces, so what it needs to find its peers is exactly what a multi-homed machine
needs: the gloo / NCCL interface (``GLOO_SOCKET_IFNAME``, set by :meth:`Hosts.popen`),
torchrun's ``--local-addr`` and which agent hosts the rendezvous store (:meth:`torchrun`).

Names are ``p3dh<pid>-<i>`` (and ``p3dh<pid>-sw``) with the pid of the test process, so
two runs never clash; at start, namespaces of that prefix whose pid is no longer alive
(a run killed before it cleaned up) are deleted. Cleanup: the context manager, and an
``atexit`` hook for a run that stops on an exception elsewhere.

Needs root and iproute2's ``ip``; :func:`hosts_or_skip` skips the test when either is
missing or the kernel refuses namespaces (an unprivileged container).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PREFIX = "p3dh"
IFNAME = "p3d0"  # the same name on every host, so one GLOO_SOCKET_IFNAME fits all
SUBNET = "10.77.0"
ROOT = Path(__file__).resolve().parents[1]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str, sig: int = signal.SIGKILL) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), sig)
        except (ProcessLookupError, ValueError):
            pass


def delete_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose test process is gone; return them."""
    gone = []
    for ns in _namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-\w+", ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(ns)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    return gone


def why_no_hosts() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def hosts_or_skip(n: int) -> "Hosts":
    reason = why_no_hosts()
    if reason:
        pytest.skip(reason)
    return Hosts(n)


class Hosts:
    """``n`` hosts on one switch; use as a context manager (it deletes them on exit)."""

    def __init__(self, n: int):
        if not 1 <= n <= 200:
            raise ValueError(f"Hosts: n={n} must be in 1..200")
        delete_leftovers()
        self.n = n
        self.base = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.base}-sw"
        self.names = [f"{self.base}-{i}" for i in range(n)]
        self._procs: list[subprocess.Popen] = []
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        sw = ("netns", "exec", self.switch, "ip")
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", f"port{i}",
                "netns", self.switch)
            _ip(*sw, "link", "set", f"port{i}", "master", "br0")
            _ip(*sw, "link", "set", f"port{i}", "up")
            host = ("netns", "exec", ns, "ip")
            _ip(*host, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip(*host, "link", "set", IFNAME, "up")
            _ip(*host, "link", "set", "lo", "up")

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def env(self, extra: dict | None = None) -> dict:
        """The environment of a command on a host: this one's, plus the interface gloo
        (and NCCL, on a GPU machine) must use -- by default gloo takes the address the
        host name resolves to, which is not on the host's link."""
        env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, NCCL_SOCKET_IFNAME=IFNAME)
        env.update(extra or {})
        return env

    def popen(self, i: int | None, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Start ``cmd`` on host ``i`` (None: in this machine's own namespace, e.g. a
        launcher that reaches the hosts itself) in its own session, output to ``log``;
        :meth:`close` kills it if it is still running."""
        where = ["ip", "netns", "exec", self.names[i]] if i is not None else []
        with open(log, "w") as f:
            proc = subprocess.Popen([*where, *cmd], stdout=f,
                                    stderr=subprocess.STDOUT, cwd=ROOT, env=self.env(env),
                                    start_new_session=True)
        self._procs.append(proc)
        return proc

    def torchrun(self, i: int, nnodes: int | str, nproc: int, port: int, run_id: str,
                 args: list[str], extra: list[str] = (), rdzv_conf: str = "",
                 log_dir: Path | None = None) -> list[str]:
        """The torchrun command for host ``i``: a c10d rendezvous whose store host 0's
        agent keeps (``is_host``: the endpoint is an address of host 0 only, which the
        agent cannot tell from the host name), and ``--local-addr`` so that the address
        the agents publish for the workers (MASTER_ADDR) is the host's own. ``rdzv_conf``:
        more ``key=value,...`` for the rendezvous; ``log_dir``: the agent's ``--log-dir``
        (without it torchrun makes a /tmp/torchelastic_* folder and never removes it)."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.addr(0)}:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={int(i == 0)}" + (f",{rdzv_conf}" if rdzv_conf else ""), "--local-addr", self.addr(i),
                *(["--log-dir", str(log_dir)] if log_dir is not None else []), *extra, "-m", "parallel3d.cli", "train", *args]

    def set_link(self, i: int, up: bool) -> None:
        """Plug host ``i``'s cable in or out (its switch port up or down)."""
        _ip("netns", "exec", self.switch, "ip", "link", "set", f"port{i}",
            "up" if up else "down")

    def kill(self, i: int) -> None:
        """Every process on host ``i`` killed at once (SIGKILL), as when a host dies."""
        _kill_namespace_processes(self.names[i])

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in [*self.names, self.switch]:
            _kill_namespace_processes(ns)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []
        for ns in [*self.names, self.switch]:
            for _ in range(5):
                if _ip("netns", "del", ns, check=False).returncode == 0 or ns not in _namespaces():
                    break
                time.sleep(0.2)
        atexit.unregister(self.close)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
