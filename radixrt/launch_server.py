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

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs

logger = logging.getLogger("radixrt.server")
WATCHDOG_PERIOD_S = 0.5


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


def run_server(args: ServerArgs) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGINT/SIGTERM after its shutdown, which would kill this
            # process before it stops its children. Here a signal only asks to exit.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    from radixrt.frontend.tokenizer_manager import TokenizerManager
    from radixrt.server.http_server import ServerContext, create_app
    from radixrt.server.launcher import Backend
    from radixrt.server.metrics import ServerMetrics

    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    backend = Backend(args)
    holder: dict[str, ServerContext] = {}
    metrics = ServerMetrics(lambda: holder["ctx"].manager.control("stats").stats)
    try:
        manager = TokenizerManager(args, backend.addrs, backend.worker, backend.check_alive, observer=metrics.observe)
    except BaseException:
        backend.shutdown(timeout=2.0)
        raise
    ctx = holder["ctx"] = ServerContext(args, manager, metrics)
    server = _Server(uvicorn.Config(
        create_app(ctx), loop="uvloop", log_level=args.log_level, timeout_graceful_shutdown=3, lifespan="on",
    ))

    async def watchdog() -> None:
        while not server.should_exit:
            why = backend.check_alive()
            if why is not None:
                ctx.dead = why
                logger.error("a backend process died: %s; shutting down", why)
                server.should_exit = True
                return
            await asyncio.sleep(WATCHDOG_PERIOD_S)

    async def serve() -> None:
        task = asyncio.create_task(watchdog())
        url = f"http://{host}:{port}"
        server_ready = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not server_ready.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(f"radixrt server ready at {url} (model {args.model_name})", flush=True)
        await server_ready
        task.cancel()

    try:
        asyncio.run(serve())
    finally:
        manager.close()
        backend.shutdown(timeout=5.0)
        with contextlib.suppress(OSError):
            sock.close()
    if ctx.dead:
        logger.error("exiting: %s", ctx.dead)
        return 1
    return 0


def run_worker_node(args: ServerArgs) -> int:
    """Node k > 0 of a multi-node server: only its tensor-parallel ranks, no HTTP. Runs until
    node 0 shuts them down (exit 0), a rank dies (exit 1), or SIGINT/SIGTERM (exit 0)."""
    from radixrt.server.launcher import Backend

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixrt launch_server", description="Serve a model over HTTP.")
    add_server_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = server_args_from(ns)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_server(args) if args.node_rank == 0 else run_worker_node(args)


if __name__ == "__main__":
    sys.exit(main())
