"""A deadline for receiving each HTTP request, which uvicorn does not have, and a
connection limit that /health is exempt from.

uvicorn closes a keep-alive connection after a few idle seconds, but any byte
cancels that timer and nothing replaces it: a client that sends half a
request (slowloris), or connects and sends nothing, holds its connection
forever. `read_deadline_protocol(seconds)` is uvicorn's h11 protocol with one
more timer: from the moment a connection opens, or a new request's first
byte arrives, the whole request (headers and body) must be in within
`seconds`, or the connection is closed. Once a request is read the timer
stops; answering (streaming included) takes as long as it takes.

The limit is uvicorn's (--max-connections as limit_concurrency): once that many
connections are open, idle ones included, every request gets 503, so 150 idle
sockets against a limit of 100 made /health answer 503 until the read deadline,
and an orchestrator would restart a server that only had too many clients.
uvicorn reads `limit_concurrency` right after parsing a request's head, with the
request's scope in place; here it reads as no limit for GET /health, which is
answered before the limit applies (it costs no more than the 503 would).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

RECEIVING = (h11.IDLE, h11.SEND_BODY)  # the client's side of the cycle while a request is still coming
UNLIMITED = (("GET", "/health"), ("HEAD", "/health"))  # answered beyond the connection limit


def read_deadline_protocol(seconds: float) -> type[H11Protocol]:
    class ReadDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _limit: int | None = None

        @property  # type: ignore[override]
        def limit_concurrency(self) -> int | None:
            scope = getattr(self, "scope", None)  # the request whose head was just parsed
            if scope is not None and (scope["method"], scope["path"]) in UNLIMITED:
                return None
            return self._limit

        @limit_concurrency.setter
        def limit_concurrency(self, value: int | None) -> None:
            self._limit = value

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state in RECEIVING:
                if self._deadline is None:
                    self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state in RECEIVING and not self.transport.is_closing():
                self.logger.info("closing a connection that did not send its request within %.0f s", seconds)
                self.transport.close()

    return ReadDeadlineProtocol
