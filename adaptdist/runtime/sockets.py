"""Listening sockets for the stores: 127.0.0.1 only for local runs, the host's own address for a job over several
hosts (never every interface)."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def loopback_listen_socket(port: int = 0) -> socket.socket:
    """A TCP socket bound to 127.0.0.1:``port`` (0: any free port) and listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(512)
    return sock


BIND_ADDR_ENV = "ADAPTDIST_BIND_ADDR"
"""Set by :func:`launch_hosts` to this host's address: a worker whose ``MASTER_ADDR`` is this address (rank 0)
makes the workers' store on a socket bound to it alone (:mod:`adaptdist.runtime.script_runner`)."""


def listen_socket(addr: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``addr``:``port`` (an IPv4 address of this host; 0: any free port) and listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock
