"""What one node of `launch_server` runs. Node 0 (run_server) binds the HTTP port first (so a busy
port fails at once), starts the scheduler and workers, serves radixrt/server/'s app over them until
SIGINT/SIGTERM or until a child dies, then stops every process. Nodes 1..N-1 (run_worker_node) run
only their tensor-parallel ranks, watched the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from typing import TYPE_CHECKING, Any

from radixrt.config import ServerArgs
from radixrt.launch.backend import Backend, start_serving
from radixrt.launch.ports import bind

if TYPE_CHECKING:
    from radixrt.server.http_common import ServerContext
    from radixrt.server.uvicorn_server import UvicornServer

logger = logging.getLogger("radixrt.server")
WATCHDOG_PERIOD_S = 0.1  # a dead child turns /health 503 (and fails its clients) this soon


def run_server(args: ServerArgs, local: ServerArgs) -> int:
    """Serve `args` (as the user gave them: what /get_model_info shows) with processes that run
    `local` (the same with the checkpoint's local directories, from prepare_checkpoint). 0 after a
    clean stop, 1 when a process died; StartupError when one could not start or the port is busy."""
    from radixrt.server.uvicorn_server import UvicornServer  # the HTTP stack, imported before any process starts

    sock = bind(args.host, args.port)
    backend, tokenizer = start_serving(local)
    ctx = _server_context(args, local, backend, tokenizer)
    server = UvicornServer(ctx)
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


def _server_context(args: ServerArgs, local: ServerArgs, backend: Backend, tokenizer: Any) -> ServerContext:
    """The TokenizerManager over the started backend, in the context the routes share; the
    backend is stopped if the manager fails to start."""
    from radixrt.frontend.tokenizer_manager import TokenizerManager
    from radixrt.server.http_common import ServerContext
    from radixrt.server.metrics import ServerMetrics, cache_sources

    holder: dict[str, ServerContext] = {}
    metrics = ServerMetrics(lambda: holder["ctx"].manager.stats(), lambda: holder["ctx"].manager.cache_report.report(),
                            args.model_name, cache_sources(args.enable_hierarchical_cache, args.storage_backend))
    try:
        manager = TokenizerManager(local, backend.addrs, backend.worker, backend.check_alive, observer=metrics.observe,
                                   model_path=args.model_path, tokenizer=tokenizer)
    except BaseException:
        backend.shutdown(timeout=2.0)
        raise
    ctx = holder["ctx"] = ServerContext(args, manager, metrics, check_alive=backend.check_alive)
    return ctx


async def _serve(server: UvicornServer, backend: Backend, sock: socket.socket) -> None:
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


async def _watchdog(server: UvicornServer, backend: Backend) -> None:
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
