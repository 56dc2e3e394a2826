"""A Mooncake master on loopback for the storage-backend tests: started, killed and restarted
on the same port (a restarted master holds nothing: the clients reconnect on their own)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from radixrt.kv_storage import master_reachable
from support.server_proc import free_port

MASTER = Path(sys.executable).parent / "mooncake_master"


class Master:
    def __init__(self) -> None:
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.opened: list = []  # clients the test made: closed before the master stops (a client
        # collected after its master died blocks the process for seconds, unmounting its memory)

    def keep(self, client):
        """client, closed at the end of the test (see opened)."""
        self.opened.append(client)
        return client

    def close_clients(self) -> None:
        for c in self.opened:
            c.connector.close()
        self.opened.clear()

    def start(self) -> Master:
        assert MASTER.exists(), f"{MASTER} is missing: pip install 'radixrt[mooncake]'"
        self.proc = subprocess.Popen([str(MASTER), f"--rpc_port={self.port}", f"--metrics_port={self.metrics_port}",
                                      "--enable_http_metadata_server=false"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not master_reachable(self.address, timeout=0.2):
            assert self.proc.poll() is None and time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.05)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def extra_config(self, segment_bytes: int = 64 << 20) -> str:
        """--hicache-storage-backend-extra-config naming this master."""
        return json.dumps({"master_server_address": self.address, "global_segment_size": segment_bytes})

    def flags(self, segment_bytes: int = 64 << 20) -> tuple[str, ...]:
        return ("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
                "--hicache-storage-backend-extra-config", self.extra_config(segment_bytes))

    def client(self):
        """A client of this master that lends the store nothing (to look at and damage values)."""
        from radixrt.kv_storage import connect
        from radixrt.settings.hicache import MooncakeSettings

        return connect(MooncakeSettings.resolve({"master_server_address": self.address}), 16 << 20)
