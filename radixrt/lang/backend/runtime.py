"""Runtime: start a local server subprocess and talk to it through a RuntimeEndpoint.

Needs the runtime installed (`pip install radixrt[srt]`); the DSL itself does not.
The server is its own process tree (`python -m radixrt.launch_server`), started in
a new session so that we can always take every process of it down.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import requests

from ..errors import RuntimeEndpointError
from .runtime_endpoint import RuntimeEndpoint


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_flags(args: dict[str, Any]) -> list[str]:
    """launch_server flags from snake_case keyword arguments: True -> `--flag`, False/None -> nothing."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not None and value is not False:
            flags += [flag, str(value)]
    return flags


class Runtime:
    """A radixrt server on a free loopback port, for the life of this object.

    `Runtime(model_path=DIR, page_size=16, ...)` takes launch_server's arguments in
    snake_case. `.url` and `.endpoint` (a RuntimeEndpoint) reach it; `shutdown()`
    (also on `with` exit and at interpreter exit) stops it.
    """

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int | None = None,
                 log_level: str = "warning", startup_timeout: float = 300, **server_args: Any) -> None:
        port = port or free_port(host)
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "radixrt.launch_server", *server_flags(
            {"model_path": str(model_path), "host": host, "port": port, "log_level": log_level, **server_args})]
        # The server's output goes to a file: a pipe nobody reads would fill and stall it.
        self._log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(startup_timeout)
            self.endpoint = RuntimeEndpoint(self.url, api_key=server_args.get("api_key"))
        except BaseException:
            self.shutdown()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeEndpointError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.25)
        raise RuntimeEndpointError(f"the server did not become healthy in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def shutdown(self, timeout: float = 20) -> None:
        """SIGTERM the server (it stops its own children); SIGKILL its whole process group if it hangs."""
        atexit.unregister(self.shutdown)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                # NOTE: only while the launcher is unreaped is its pid (= the group id) surely ours.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Runtime({self.url!r})"
