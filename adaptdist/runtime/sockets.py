"""Loopback sockets for local runs: every store of a local run listens on 127.0.0.1 only."""

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
