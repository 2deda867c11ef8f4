"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs to a bridge (test helper).

:class:`Hosts` makes ``n`` namespaces, each with ``lo`` up and one veth end holding ``SUBNET.(i+1)/24``; the
other ends hang on a bridge in the root namespace that has no address, so the namespaces reach each other only
on their own addresses (nothing is routed through the root namespace). Names start with :data:`PREFIX` and hold
the creating process's pid, so a run never collides with a crashed earlier one, and :func:`remove_leftovers`
removes what a dead process of ours left (never what a live one, e.g. a concurrent test run, uses).

Needs root and a kernel that allows ``ip netns`` (``Hosts.create`` raises :class:`Refused` with the reason
otherwise; tests skip on it).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time

PREFIX = "admh"
"""Every namespace, bridge and veth made here starts with this (then the pid in hex, a counter, a role)."""

_counter = itertools.count()


class Refused(Exception):
    """The kernel or the user's rights do not allow network namespaces here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip() or p.returncode}")
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    p = _ip("netns", "pids", ns, check=False)
    for pid in (int(x) for x in p.stdout.split() if x.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def remove_leftovers() -> list[str]:
    """Remove the namespaces and links of :data:`PREFIX` whose creating process is dead; returns their names."""
    pat = re.compile(rf"^{PREFIX}([0-9a-f]+)x")
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = pat.match(name)
        if m and not _alive(int(m.group(1), 16)):
            _kill_namespace_processes(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@")[0]
        m = pat.match(name)
        if m and not _alive(int(m.group(1), 16)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


class Hosts:
    """``n`` network namespaces on one bridge; use as a context manager (removes everything on exit).

    Attributes:
        names: the namespaces, host ``i`` is ``names[i]``.
        addrs: host ``i``'s address, ``f"{subnet}.{i + 1}"``.
        links: the root-side veth end of host ``i`` (``ip link set LINK down`` cuts host ``i`` off).
    """

    def __init__(self, n: int, subnet: str = "10.213.0"):
        tag = f"{PREFIX}{os.getpid():x}x{next(_counter)}"
        assert len(tag) + 2 <= 15, tag  # interface names are at most 15 characters
        self.bridge = f"{tag}br"
        self.names = [f"{tag}n{i}" for i in range(n)]
        self.links = [f"{tag}h{i}" for i in range(n)]
        self.peers = [f"{tag}p{i}" for i in range(n)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def create(self) -> "Hosts":
        """Make the bridge, the namespaces and the links, then check that host 0 reaches every other.

        Raises:
            Refused: not root, or the kernel refused a namespace or a link (the message says which).
        """
        if os.geteuid() != 0:
            raise Refused("network namespaces need root (ip netns add); run as root to test several hosts")
        try:
            subprocess.run(["ip", "-V"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Refused(f"no usable `ip` command (iproute2): {e}") from None
        remove_leftovers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
        except RuntimeError as e:
            raise Refused(f"the kernel refused a bridge: {e}") from None
        try:
            # bridged frames skip iptables (a FORWARD policy of DROP, e.g. docker's, would eat them)
            _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
            _ip("link", "set", self.bridge, "up")
            for ns, link, peer, addr in zip(self.names, self.links, self.peers, self.addrs):
                try:
                    _ip("netns", "add", ns)
                except RuntimeError as e:
                    raise Refused(f"the kernel refused a network namespace: {e}") from None
                _ip("link", "add", link, "type", "veth", "peer", "name", peer)
                _ip("link", "set", peer, "netns", ns)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", peer)
                _ip("-n", ns, "link", "set", peer, "up")
            for i in range(1, len(self.names)):
                self.check_reach(0, i)
        except BaseException:
            self.remove()
            raise
        return self

    def check_reach(self, i: int, j: int, timeout_s: float = 10.0) -> None:
        """Host ``i`` opens a TCP connection to a listener on host ``j`` (within ``timeout_s``).

        Raises:
            Refused: it cannot (the bridge drops the traffic here).
        """
        code = ("import socket,sys\ns=socket.socket();s.bind((sys.argv[1],0));s.listen(1);print(s.getsockname()[1],"
                "flush=True);s.settimeout(%r);s.accept()" % timeout_s)
        server = subprocess.Popen(self.command(j, [sys.executable, "-c", code, self.addrs[j]]),
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = server.stdout.readline().strip()
            client = subprocess.run(self.command(i, [sys.executable, "-c",
                                                     "import socket,sys;socket.create_connection((sys.argv[1],"
                                                     f"int(sys.argv[2])),timeout={timeout_s!r})",
                                                     self.addrs[j], port]),
                                    capture_output=True, text=True, timeout=timeout_s + 10)
            if client.returncode != 0:
                raise Refused(f"namespace {self.names[i]} cannot reach {self.addrs[j]} over the bridge: "
                              f"{client.stderr.strip().splitlines()[-1:]}")
        finally:
            server.kill()
            server.wait()

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``i``'s namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def start(self, i: int, argv: list[str], **popen) -> subprocess.Popen:
        """Start ``argv`` in host ``i``'s namespace, in a session of its own; it is killed by :meth:`remove`."""
        p = subprocess.Popen(self.command(i, argv), start_new_session=True, **popen)
        self.procs.append(p)
        return p

    def listeners(self, i: int) -> set[tuple[str, int]]:
        """The (address, port) of every listening TCP socket in host ``i``'s namespace (``/proc/net/tcp``, tcp6;
        an IPv6 address as its hex)."""
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            p = subprocess.run(self.command(i, ["cat", table]), capture_output=True, text=True, timeout=30)
            for line in p.stdout.splitlines()[1:]:
                cols = line.split()
                if len(cols) < 4 or cols[3] != "0A":  # 0A: LISTEN
                    continue
                addr_hex, port_hex = cols[1].split(":")
                addr = (socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]) if len(addr_hex) == 8 else addr_hex)
                found.add((addr, int(port_hex, 16)))
        return found

    def cut(self, i: int) -> None:
        """Cut host ``i`` off the network (its link down; its processes live on)."""
        _ip("link", "set", self.links[i], "down")

    def kill(self, i: int) -> int:
        """SIGKILL every process in host ``i``'s namespace (a lost machine); returns how many."""
        p = _ip("netns", "pids", self.names[i], check=False)
        pids = [int(x) for x in p.stdout.split() if x.isdigit()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def remove(self) -> None:
        """Kill every process started in the namespaces, remove the namespaces, links and bridge. Idempotent."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for ns in self.names:
            _kill_namespace_processes(ns)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.names:
            _ip("netns", "del", ns, check=False)  # deletes the veth pair with it
        for link in self.links:
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> "Hosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. Raises AssertionError naming ``what``."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)
    return time.monotonic() - t0


def free_port() -> int:
    """A port number (namespaces are fresh: any port is free in them)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
