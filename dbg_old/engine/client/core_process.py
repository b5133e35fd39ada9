"""`CoreProcess`: the engine process and the two IPC sockets to it, as both clients use them;
`CoreLink`: one client's end of its sockets.

Each client binds its two sockets; the core connects to every client's pair and says `Ready` (or
`Failed`) to each once it has built everything. The process that spawns the core is client 0;
other API server processes (`--api-server-count`) attach to it with pairs of their own.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.loop import run_engine_core
from engine.core.protocol import ControlReply, Failed, FromCore, Ready, Shutdown, ToCore
from engine.errors import EngineDeadError, from_kind

# How long a client waits for the core to build itself, and for it to exit, seconds.
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0
POLL_MS = 200


def _memory_saver_hook(config: EngineConfig) -> contextlib.AbstractContextManager:
    """The environment the engine process starts in: with torch_memory_saver's LD_PRELOAD hook
    when its memory will be on CUDA in releasable regions (engine/memory/regions.py says why preload)."""
    on_cuda = config.device.startswith("cuda") or (config.device == "auto" and _cuda_available())
    if not (config.memory_saver and on_cuda):
        return contextlib.nullcontext()
    try:
        from torch_memory_saver import configure_subprocess
    except ImportError:
        return contextlib.nullcontext()  # the engine logs that regions are no-ops
    return configure_subprocess()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _pid_alive(pid: int) -> bool:
    """Whether a process that is not our child exists (its parent reaps it within a watchdog
    period of its death; a `Failed` message usually says so first)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class CoreLink:
    """One client's end of its two sockets to the engine process (`pipe`: to-core and from-core
    addresses, which this end binds and the engine connects to), and what the engine said in
    `Ready`. The process that starts the engine holds a `CoreProcess`; another API server process
    attaches to the same engine with `CoreLink.attach`."""

    def __init__(self, pipe: tuple[str, str], pid: int | None = None) -> None:
        # The socket addresses of every client this link knows, its own first: all of them where
        # this process started the engine (CoreProcess).
        self.pipes = [pipe]
        self.pid = pid  # the engine process's
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(pipe[0])
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(pipe[1])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self.dead: str | None = None
        self.info: dict[str, Any] = {}

    @classmethod
    def attach(cls, pipe: tuple[str, str], engine_pid: int) -> CoreLink:
        """This process's link to an engine another process started, once it has said Ready."""
        link = cls(pipe, engine_pid)
        link.wait_ready()
        return link

    def wait_ready(self) -> None:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            msg = self.recv(timeout_ms=POLL_MS)
            if isinstance(msg, Ready):
                self.info, self.state = msg.info, msg.state
                return
            if self.dead is not None:
                self.close()
                raise EngineDeadError(self.dead)
            waited += POLL_MS / 1000
        self.close()
        raise EngineDeadError(f"engine did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    def async_sockets(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """asyncio shadows of (to core, from core), for a client inside an event loop."""
        return zmq.asyncio.Socket.from_socket(self._to_core), zmq.asyncio.Socket.from_socket(self._from_core)

    def encode(self, msg: ToCore) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> FromCore:
        msg = self._decoder.decode(data)
        if isinstance(msg, Failed):
            self.dead = msg.error
        return msg

    def check_alive(self) -> bool:
        """False once the core has said it failed or its process has exited."""
        if self.dead is None and self.pid is not None and not _pid_alive(self.pid):
            self.dead = "engine process exited"
        return self.dead is None

    def send(self, msg: ToCore) -> None:
        """Send, waiting while the core's queue is full, but never on a dead core (a PUSH socket
        whose peer is gone would block forever)."""
        data = self._encoder.encode(msg)
        while self.check_alive():
            try:
                self._to_core.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._to_core.poll(POLL_MS, zmq.POLLOUT)
        raise EngineDeadError(self.dead)

    def recv(self, timeout_ms: int) -> FromCore | None:
        """One message from the core, or None after `timeout_ms`. Notices a dead core."""
        if self._from_core.poll(timeout_ms):
            return self.decode(self._from_core.recv())
        self.check_alive()
        return None

    def close(self) -> None:
        """Close this end (the engine goes on: it is its starter's to stop)."""
        self._to_core.close()
        self._from_core.close()
        self._ctx.term()


class CoreProcess(CoreLink):
    """The engine process, started here, and client 0's link to it. `pipes` are the addresses of
    all `num_clients` clients (the others attach from their own processes: `CoreLink.attach`)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", num_clients: int = 1) -> None:
        self._dir = tempfile.mkdtemp(prefix="siesta-")
        pipes = [(f"ipc://{os.path.join(self._dir, f'to_core{i}')}", f"ipc://{os.path.join(self._dir, f'from_core{i}')}")
                 for i in range(num_clients)]
        super().__init__(pipes[0])
        self.pipes = pipes
        self.process = mp.get_context("spawn").Process(
            target=run_engine_core, args=(config, self.pipes, log_level), name="siesta-engine", daemon=True
        )
        with _memory_saver_hook(config):
            self.process.start()
        self.pid = self.process.pid
        self.wait_ready()

    def check_alive(self) -> bool:
        if self.dead is None and not self.process.is_alive():
            self.dead = f"engine process exited with code {self.process.exitcode}"
        return self.dead is None

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._to_core.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(SHUTDOWN_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        super().close()
        shutil.rmtree(self._dir, ignore_errors=True)


def reply_result(reply: ControlReply, reply_type: Any) -> Any:
    """A control reply's result, decoded as its call's `reply` type; a failure raises the
    engine's error type for it (engine/errors.py)."""
    if reply.error is not None:
        raise from_kind(reply.error.kind, reply.error.message)
    return msgspec.msgpack.decode(reply.result, type=reply_type)
