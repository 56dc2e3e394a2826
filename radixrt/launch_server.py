"""`python -m radixrt.launch_server` / `radixrt launch_server`: the command line of the HTTP server and
its processes. It parses and checks the flags, then hands over to radixrt/launch/: node 0 serves
(node.run_server), nodes 1..N-1 of --nnodes N run only their worker ranks (node.run_worker_node),
--dp-size N runs N servers behind a router (data_parallel.run_data_parallel). Exits non-zero, with
the reason logged, when a process could not start or died.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.launch.backend import prepare_checkpoint
from radixrt.launch.process import StartupError

logger = logging.getLogger("radixrt.server")


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
            from radixrt.launch.data_parallel import preflight
            preflight(args)  # the router is installed; cores or GPUs for every replica
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    warn_about_keys(args)
    try:
        if args.dp_size > 1:
            from radixrt.launch.data_parallel import run_data_parallel
            return run_data_parallel(args)
        from radixrt.launch.node import run_server, run_worker_node
        return run_server(args, local) if args.node_rank == 0 else run_worker_node(local)
    except StartupError as e:  # a busy port, or a process that could not start (its log says more; all are stopped)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while starting: Backend stopped what it had started
        return 130


if __name__ == "__main__":
    sys.exit(main())
