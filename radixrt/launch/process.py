"""The one process wrapper: a started command, its name, pid and exit code, and how to stop it.

The Backend starts its worker ranks and scheduler with it (their spec written to a stdin pipe);
a data-parallel deployment starts its replicas and the router with it (each in a process group
of its own). Nothing here knows what the command is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from radixrt.utils.procs import die_with_parent

START_TIMEOUT_S = 600  # the longest a started process may take to say it is ready


class StartupError(RuntimeError):
    """A process could not start (its own log says more); the message is one line for the user."""


class Process:
    """One started command. stdout and stderr are inherited: it logs where this process does.

    stdin: a pipe that send() writes frames to (closed after the last).
    own_group: a process group of its own, so a terminal's Ctrl-C reaches only this process and
    kill() reaches the command's own children too. Out of reach of the group signals that would
    have ended it with us, it is set to die (SIGKILL) when this process does, before it runs.
    cores: the CPU cores it may run on (its affinity mask), set before it runs.
    """

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, *, stdin: bool = False,
                 own_group: bool = False, cores: tuple[int, ...] = ()) -> None:
        self.name = name
        self.own_group = own_group
        parent = os.getpid()

        def in_child() -> None:  # between fork and exec; the death signal survives the exec
            if own_group:
                die_with_parent(parent)
            if cores:
                os.sched_setaffinity(0, cores)

        # NOTE: start from the main thread: PR_SET_PDEATHSIG fires when the starting *thread* exits.
        self.popen = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE if stdin else None,
                                      process_group=0 if own_group else None,
                                      preexec_fn=in_child if own_group or cores else None)

    def send(self, frame: bytes, last: bool = True) -> None:
        """Write one frame to its stdin (closed after the last)."""
        try:
            self.popen.stdin.write(frame)
            self.popen.stdin.flush()
            if last:
                self.popen.stdin.close()
        except BrokenPipeError:  # it died; its exitcode says how
            pass

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status after (-N when signal N ended it)."""
        return self.popen.poll()

    def terminate(self) -> None:
        """SIGTERM to it alone: a leader stops its own children in order."""
        if self.exitcode is None:
            self.popen.terminate()

    def wait(self, timeout: float) -> bool:
        """True once it has exited."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, timeout))
        return self.exitcode is not None

    def kill(self) -> None:
        """SIGKILL (to its whole group when it leads one), then reap it."""
        if self.own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        else:
            self.popen.kill()
        self.wait(5.0)
