"""`python -m radixrt.launch_server` / `radixrt launch_server`: the HTTP server and its processes.

Binds the port first (so a busy port fails at once), starts the scheduler and
workers, serves until SIGINT/SIGTERM or until a child dies, then stops every
process. Exits non-zero, with the reason logged, when a child died. With
--nnodes N, node 0 serves and nodes 1..N-1 run only their worker ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.server.launcher import Backend, StartupError, prepare_checkpoint

if TYPE_CHECKING:
    from radixrt.server.http_common import ServerContext

logger = logging.getLogger("radixrt.server")
WATCHDOG_PERIOD_S = 0.1  # a dead child turns /health 503 (and fails its clients) this soon
SHUTDOWN_MARGIN_S = 5.0


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def run_server(args: ServerArgs, local: ServerArgs) -> int:
    """Serve `args` (as the user gave them: what /get_model_info shows) with processes that run
    `local` (the same with the checkpoint's local directories, from prepare_checkpoint)."""
    server_class = _uvicorn_server_class()  # imports the HTTP stack before any process starts
    sock = bind(args.host, args.port)
    backend = Backend(local)
    ctx = _server_context(args, local, backend)
    server = server_class(ctx)
    try:
        asyncio.run(_serve(server, backend, sock))
    finally:
        ctx.manager.close()
        backend.shutdown(timeout=5.0)
        with contextlib.suppress(OSError):
            sock.close()
    if ctx.dead:
        logger.error("exiting: %s", ctx.dead)
        return 1
    return 0


def _server_context(args: ServerArgs, local: ServerArgs, backend: Backend) -> ServerContext:
    """The TokenizerManager over the started backend, in the context the routes share; the
    backend is stopped if the manager fails to start."""
    from radixrt.frontend.tokenizer_manager import TokenizerManager
    from radixrt.server.http_common import ServerContext
    from radixrt.server.metrics import ServerMetrics

    holder: dict[str, ServerContext] = {}
    metrics = ServerMetrics(lambda: holder["ctx"].manager.stats(), lambda: holder["ctx"].manager.cache_report.report(),
                            args.model_name)
    try:
        manager = TokenizerManager(local, backend.addrs, backend.worker, backend.check_alive, observer=metrics.observe,
                                   model_path=args.model_path)
    except BaseException:
        backend.shutdown(timeout=2.0)
        raise
    ctx = holder["ctx"] = ServerContext(args, manager, metrics, check_alive=backend.check_alive)
    return ctx


async def _serve(server: Any, backend: Backend, sock: socket.socket) -> None:
    """Serve on `sock` until the server exits, watching the backend; say so once it is ready."""
    host, port = sock.getsockname()[:2]
    task = asyncio.create_task(_watchdog(server, backend))
    url = f"http://{host}:{port}"
    server_ready = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not server_ready.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"radixrt server ready at {url} (model {server.ctx.args.model_name})", flush=True)
    await server_ready
    task.cancel()


async def _watchdog(server: Any, backend: Backend) -> None:
    """When a backend process dies: fail every waiting client (503) and ask the server to exit."""
    ctx = server.ctx
    while not server.should_exit:
        why = backend.check_alive()
        if why is not None:
            ctx.dead = why
            logger.error("a backend process died: %s; shutting down", why)
            ctx.manager.backend_died(why)  # every waiting client gets its 503 now
            server.should_exit = True
            return
        await asyncio.sleep(WATCHDOG_PERIOD_S)


def _uvicorn_server_class() -> type:
    import uvicorn

    from radixrt.server.http_limits import read_deadline_protocol
    from radixrt.server.http_server import create_app

    class Server(uvicorn.Server):
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

    return Server


def run_worker_node(args: ServerArgs) -> int:
    """Node k > 0 of a multi-node server: only its tensor-parallel ranks, no HTTP. Runs until
    node 0 shuts them down (exit 0), a rank dies (exit 1), or SIGINT/SIGTERM (exit 0)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    backend = Backend(args)
    print(f"radixrt node {args.node_rank} ready: its ranks joined node 0 at {args.dist_init_addr}", flush=True)
    why = None
    try:
        while not stop.wait(WATCHDOG_PERIOD_S) and why is None:
            why = backend.check_alive()
    finally:
        backend.shutdown(timeout=0.0 if stop.is_set() else 5.0)
    if why is not None and any(p.exitcode != 0 for p in backend.processes):
        logger.error("exiting: %s", why)
        return 1
    return 0


def warn_about_keys(args: ServerArgs) -> None:
    """SGLang lets the api key reach the admin routes when no admin key is set: say so at start."""
    if args.api_key and not args.admin_api_key and args.node_rank == 0:
        logger.warning("--api-key without --admin-api-key: every API user can reach the admin routes (/flush_cache, "
                       "/abort_request, /update_weights_from_disk), as in SGLang; set --admin-api-key to keep them "
                       "to operators")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, not the usage of ~50 flags above the message."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after a clean stop; 2 for a mistake in the command line, found before
    anything starts (a bad flag or value, a model_path that is neither a checkpoint directory
    nor a Hugging Face repo id found or fetched); 1 when a process failed to start or died.
    Each error is one line on stderr."""
    parser = OneLineParser(prog="radixrt launch_server", description="Serve a model over HTTP.")
    add_server_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = server_args_from(ns)
        local = prepare_checkpoint(args)  # a repo id becomes its cached snapshot directory
        if args.dp_size > 1:
            from radixrt.server.data_parallel import preflight
            preflight(args)  # the router is installed; cores or GPUs for every replica
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warn_about_keys(args)
    try:
        if args.dp_size > 1:
            from radixrt.server.data_parallel import run_data_parallel
            return run_data_parallel(args)
        return run_server(args, local) if args.node_rank == 0 else run_worker_node(local)
    except StartupError as e:  # the child logged the details; its processes are stopped
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: Backend stopped what it had started
        return 130


if __name__ == "__main__":
    sys.exit(main())
