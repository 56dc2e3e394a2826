"""Ports: the one free-port helper, and binding a public port before anything starts (a busy
port fails at once, not after the model has loaded)."""

from __future__ import annotations

import contextlib
import socket

from radixrt.launch.process import StartupError


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (each socket held until all are picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def free_port() -> int:
    """One free loopback port."""
    return free_ports(1)[0]


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; StartupError (one line) when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock
