"""Typed zmq channels: one message type (or tagged union) per socket, msgspec-encoded.

Receivers block (optionally with a timeout); nothing here busy-polls.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")


class Sender(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool = False, timeout_ms: int = -1) -> None:
        """timeout_ms: how long send() may wait for a peer (a bound PUSH with no peer
        connected blocks); past it, send() raises zmq.Again. -1: forever."""
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: T) -> None:
        self.sock.send(self._enc.encode(msg), copy=False)


class PeerLost(Exception):
    """A watched connection's peer went away."""


class Undecodable(Exception):
    """A message arrived that does not decode as the socket's type; it is consumed, and
    `raw` (the payload) and `error` (msgspec's, naming the field) say what it was."""

    def __init__(self, raw: bytes, error: msgspec.DecodeError) -> None:
        super().__init__(str(error))
        self.raw, self.error = raw, error


class Receiver(Generic[T]):
    def __init__(self, ctx: zmq.Context, addr: str, msg_type: Any, bind: bool = True, watch_peer: bool = False) -> None:
        """watch_peer (with bind=False over tcp): recv() raises PeerLost once the established
        session to the peer closes, e.g. when node 0 of a multi-node server goes away."""
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._dec = msgspec.msgpack.Decoder(msg_type)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if watch_peer else None
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block until a message arrives; None if timeout_ms passes first. Raises Undecodable
        for a message that is not a T (the next recv() goes on with the next message)."""
        events = dict(self._poller.poll(timeout_ms))
        if self.sock in events:  # a message that arrived before the peer left is still delivered
            frame = self.sock.recv(copy=False)
            try:
                return self._dec.decode(frame.buffer)
            except msgspec.DecodeError as e:  # ValidationError included
                raise Undecodable(frame.bytes, e) from None
        if self._monitor is not None and self._monitor in events:
            raise PeerLost(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return None

    def recv_nowait(self) -> T | None:
        return self.recv(timeout_ms=0)
