"""Typed zmq channels: one message type (or tagged union) per socket, msgspec-encoded.

Receivers block (optionally with a timeout); nothing here busy-polls.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")


class Sender(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: T) -> None:
        self.sock.send(self._enc.encode(msg), copy=False)


class Receiver(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, msg_type: Any, bind: bool = True) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._dec = msgspec.msgpack.Decoder(msg_type)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block until a message arrives; None if timeout_ms passes first."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return self._dec.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self) -> T | None:
        return self.recv(timeout_ms=0)
