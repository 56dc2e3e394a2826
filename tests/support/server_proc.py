"""Start a real `radixrt launch_server` on 127.0.0.1 and a free port; always stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import requests

from radixrt.launch.ports import free_port
from support.helpers import assert_pool_idle, wait_idle

ROOT = Path(__file__).resolve().parents[2]
# The flags of the server the modules share (conftest.server): any test against it may rely on them.
SERVER_PAGE_SIZE = 16
# Compact JSON under a json_schema: free whitespace lets random weights pad JSON until max_new_tokens.
SERVER_ARGS = ("--page-size", str(SERVER_PAGE_SIZE), "--max-total-tokens", "16384", "--constrained-json-disable-any-whitespace",
               "--tool-call-parser", "qwen25")


def free_port_run(n: int, tries: int = 100) -> int:
    """A port p with p .. p + n - 1 all free now (a multi-node server binds the ports just above
    its dist_init_addr's: a client connection's ephemeral port there once failed a start)."""
    for _ in range(tries):
        p = free_port()
        with contextlib.ExitStack() as held:
            try:
                for q in range(p, p + n):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", q))
            except OSError:
                continue
        return p
    raise RuntimeError(f"no run of {n} free ports in {tries} tries")


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is pid (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def spawned_children(pid: int) -> list[int]:
    """The server's worker ranks and scheduler, in start order (ranks first): the children
    started as `python -c "from radixrt.launch.child import main; ..."`."""
    out = []
    for child in sorted(child_pids(pid)):
        with contextlib.suppress(OSError):
            if b"radixrt.launch.child" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
    return out


@contextlib.contextmanager
def running_server(model_path: Path, *extra: str, timeout: float = 120) -> Iterator[tuple[str, subprocess.Popen]]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt.launch_server", "--model-path", str(model_path),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
            with contextlib.suppress(requests.ConnectionError, requests.Timeout):
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise TimeoutError("server did not become healthy")
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 15) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in child_pids(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    return proc.returncode


def server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", timeout=10).json()


def assert_healthy_and_idle(url: str, timeout: float = 10) -> None:
    """/health is 200, nothing runs or waits, and every KV page is free or cached."""
    assert requests.get(url + "/health", timeout=5).status_code == 200
    assert_pool_idle(wait_idle(lambda: server_info(url), timeout))
