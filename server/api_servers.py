"""`ApiServers`: the API server processes beyond the first (`siesta serve --api-server-count N`).

One API server process (uvicorn, FastAPI, tokenizer, detokenizer) tops out at one core: a burst
of requests reaches the engine only as fast as that core admits them. With N > 1, as vLLM's
`--api-server-count` does, `siesta serve`'s own process is API server 0 and starts the engine with
N client pipes (engine/core/client_pipes.py); it then spawns API servers 1..N-1, each attached to
its own pipe. Rules:
- every process listens on the same port with its own SO_REUSEPORT socket: the kernel spreads
  new connections over them; a connection stays with the process that accepted it;
- the engine routes each request's tokens to the process that sent it, and tells every process
  the engine state after any control call (503s, weight version), whichever process took it;
- metrics are prometheus_client's multiprocess kind: `/metrics` on any process counts all;
- process 0 supervises: a helper that dies stops the server (non-zero exit, as an engine death
  does), helpers stop with process 0, and a helper whose parent is gone exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.process_title import set_process_title
from server.server_config import KEEP_ALIVE_S, ServerConfig

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("siesta.server")

# How often the supervisor looks at its helpers, and a helper at its parent, seconds.
WATCH_S = 0.5
# How long a helper gets to finish its responses when the server stops, and to start, seconds.
STOP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 300.0


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port) that the other API server processes share by
    SO_REUSEPORT (each binds its own)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def share_metrics() -> str:
    """Switch this process, and the processes it spawns from now on, to prometheus_client's
    multiprocess metrics; returns their directory. Call before any metric exists."""
    from prometheus_client import values

    path = tempfile.mkdtemp(prefix="siesta-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.get_value_class()
    return path


class ApiServers:
    """API server processes 1..N-1, attached to an engine that process 0 started."""

    def __init__(
        self, engine: EngineConfig, server: ServerConfig, pipes: list[tuple[str, str]], engine_pid: int, metrics_dir: str
    ) -> None:
        """`pipes`: the socket addresses of clients 1..N-1 (`AsyncEngineClient.pipes[1:]`);
        `metrics_dir`: `share_metrics()`'s, removed by `stop`."""
        self.metrics_dir = metrics_dir
        ctx = mp.get_context("spawn")
        self.serving = [ctx.Event() for _ in pipes]  # set once helper i + 1 listens
        self.procs = [
            ctx.Process(target=run_api_server, args=(i, engine, server, pipe, engine_pid, os.getpid(), serving),
                        name=f"siesta-api-{i}", daemon=True)
            for i, (pipe, serving) in enumerate(zip(pipes, self.serving, strict=True), start=1)
        ]
        self._stopping = False

    def start(self, on_death: Callable[[str], None]) -> None:
        """Spawn the helpers and wait until each listens (so that `siesta serve` is ready when all
        its processes are); `on_death(why)` runs (in a thread) if one exits before `stop`."""
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for p, serving in zip(self.procs, self.serving, strict=True):
            while not serving.wait(WATCH_S):
                if not p.is_alive() or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"API server process {p.name} did not start (exit code {p.exitcode})")
        threading.Thread(target=self._watch, args=(on_death,), name="siesta-api-watch", daemon=True).start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        while not self._stopping:
            for p in self.procs:
                if not p.is_alive() and not self._stopping:
                    on_death(f"API server process {p.name} exited with code {p.exitcode}")
                    return
            time.sleep(WATCH_S)

    def stop(self) -> None:
        """Stop the helpers (SIGTERM: uvicorn finishes what it serves), killed after STOP_TIMEOUT_S;
        then remove the metrics' directory."""
        self._stopping = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def run_api_server(
    index: int, engine: EngineConfig, server: ServerConfig, pipe: tuple[str, str], engine_pid: int, parent: int,
    serving: Event,
) -> None:
    """Entry point of API server process `index`: attach to the engine, serve the shared port
    (`serving` is set once it listens) until stopped, or until the engine or the parent process
    is gone."""
    set_process_title(f"siesta::api{index}")
    import uvicorn

    from engine.client.async_client import AsyncEngineClient
    from engine.client.core_process import CoreLink
    from server.app import build_app

    logging.basicConfig(level=server.log_level, format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s")
    link = CoreLink.attach(pipe, engine_pid)
    client = AsyncEngineClient(engine, log_level=server.log_level, link=link)

    def stop() -> None:
        uv.should_exit = True

    app = build_app(client, server, stop, api_server_index=index)
    uv = uvicorn.Server(uvicorn.Config(
        app, log_level=server.log_level.lower(), timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S
    ))
    threading.Thread(target=_watch, args=(uv, parent, serving), name="siesta-parent-watch", daemon=True).start()
    uv.run(sockets=[listen_socket(server.host, server.port)])


def _watch(uv: uvicorn.Server, parent: int, serving: Event) -> None:
    """In a helper: set `serving` once uvicorn listens; stop it once the parent is gone."""
    while os.getppid() == parent:
        if uv.started and not serving.is_set():
            serving.set()
        time.sleep(0.01 if not serving.is_set() else WATCH_S)
    log.warning("the server's first process is gone; this API server exits")
    uv.should_exit = True
