"""`CoreProcess`: the engine process and the two IPC sockets to it, as both clients use them;
`CoreLink`: one client's end of its sockets.

Each client binds its two sockets; the core connects to every client's pair and says `Ready` (or
`Failed`) to each once it has built everything. The process that spawns the core is client 0;
other API server processes (`--api-server-count`) attach to it with pairs of their own.

The engine process is spawned: it imports the starter's main module again, as `__mp_main__`. A
script that starts an engine outside `if __name__ == "__main__":` would start one more from there;
`refuse_while_bootstrapping` stops that child at once, and its starter raises one line that names
the fix (`BOOTSTRAP_EXIT` is how the child tells it).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.process_title import set_process_title
from engine.core.protocol import ControlReply, Failed, FromCore, Ready, Shutdown, ToCore
from engine.errors import EngineDeadError, from_kind

# How long a client waits for the core to build itself, and for it to exit, seconds.
STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0
POLL_MS = 200
# The exit code of an engine process stopped by `refuse_while_bootstrapping`.
BOOTSTRAP_EXIT = 3
MAIN_GUARD_ERROR = (
    "the engine was started at import time of the main script, which the spawned engine process "
    "imports again: put the script's code under `if __name__ == \"__main__\":`"
)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("siesta.engine")


def refuse_while_bootstrapping() -> None:
    """Exit at once, with `BOOTSTRAP_EXIT` and no traceback, in a spawned child that is still
    importing its parent's main module (where multiprocessing sets `_inheriting`); the parent
    raises `MAIN_GUARD_ERROR`. Anywhere else, nothing."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(BOOTSTRAP_EXIT)


def run_engine_process(config: EngineConfig, pipes: list[tuple[str, str]], log_level: str, spawned_at: float) -> None:
    """The engine process's entry point: its name (`siesta::engine`), a log line of how long the
    spawn and its imports took (`spawned_at`: the parent's `time.time()` at start), then the loop."""
    set_process_title("siesta::engine")
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    from engine.core.loop import run_engine_core  # torch: the longest import

    log.info("engine process %d up in %.1f s (spawn and imports)", os.getpid(), time.time() - spawned_at)
    run_engine_core(config, pipes, log_level)


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
        """Close this end (the engine goes on: it is its starter's to stop). Twice is once."""
        if self._to_core.closed:
            return
        self._to_core.close()
        self._from_core.close()
        self._ctx.term()


class CoreProcess(CoreLink):
    """The engine process, started here, and client 0's link to it. `pipes` are the addresses of
    all `num_clients` clients (the others attach from their own processes: `CoreLink.attach`).
    The constructor returns once the process is started; `wait_ready` waits until it has built
    everything (the starter loads its tokenizer meanwhile)."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO", num_clients: int = 1) -> None:
        refuse_while_bootstrapping()
        self._dir = tempfile.mkdtemp(prefix="siesta-")
        pipes = [(f"ipc://{os.path.join(self._dir, f'to_core{i}')}", f"ipc://{os.path.join(self._dir, f'from_core{i}')}")
                 for i in range(num_clients)]
        super().__init__(pipes[0])
        self.pipes = pipes
        self.process = mp.get_context("spawn").Process(
            target=run_engine_process, args=(config, self.pipes, log_level, time.time()), name="siesta::engine",
            daemon=True,
        )
        with _memory_saver_hook(config):
            self.process.start()
        self.pid = self.process.pid
        log.info("engine process %d started", self.pid)

    def check_alive(self) -> bool:
        if self.dead is None and not self.process.is_alive():
            code = self.process.exitcode
            self.dead = MAIN_GUARD_ERROR if code == BOOTSTRAP_EXIT else f"engine process exited with code {code}"
        return self.dead is None

    def close(self) -> None:
        if self._to_core.closed:
            return
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
