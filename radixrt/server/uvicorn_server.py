"""The HTTP server itself: uvicorn serving create_app(ctx), with signals that only ask it to exit
and a shutdown that drains. Who starts and watches the processes behind it is radixrt/launch/."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any

import uvicorn

from radixrt.server.http_common import ServerContext
from radixrt.server.http_limits import read_deadline_protocol
from radixrt.server.http_server import create_app

SHUTDOWN_MARGIN_S = 5.0


class UvicornServer(uvicorn.Server):
    """uvicorn serving create_app(ctx), with signals that only ask to exit and a shutdown that drains.

    uvicorn re-raises SIGINT/SIGTERM after its shutdown, which would kill this process
    before it stops its children: here a signal only asks to exit. At shutdown, new
    requests get 503 at once; running ones have graceful_shutdown_timeout to finish,
    then get a 503 (an error event on a started stream) instead of a cancelled task.
    """

    def __init__(self, ctx: ServerContext) -> None:
        args = ctx.args
        super().__init__(uvicorn.Config(
            create_app(ctx), loop="uvloop", log_level=args.log_level, lifespan="on",
            http=read_deadline_protocol(args.request_read_timeout), limit_concurrency=args.max_connections,
            # the drain below fails what is still running at graceful_shutdown_timeout; this only backs it up
            timeout_graceful_shutdown=args.graceful_shutdown_timeout + SHUTDOWN_MARGIN_S,
        ))
        self.ctx = ctx

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        ctx, grace = self.ctx, self.ctx.args.graceful_shutdown_timeout
        ctx.draining = ctx.draining or "the server is shutting down"
        why = f"the server is shutting down: the request did not finish within {grace:g} s (--graceful-shutdown-timeout)"
        drain = asyncio.get_running_loop().call_later(grace, ctx.manager.fail_pending, why, 503)
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()
