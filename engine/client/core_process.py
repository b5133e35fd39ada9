"""`CoreProcess`: the engine process and the two IPC sockets to it, as both clients use them.

The client binds both sockets, then spawns the core, which connects to them; the core says `Ready`
(or `Failed`) once it has built everything.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
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


class CoreProcess:
    """The engine process and the two sockets to it."""

    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self._dir = tempfile.mkdtemp(prefix="siesta-")
        in_addr = f"ipc://{os.path.join(self._dir, 'to_core')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'from_core')}"
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(in_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        self.process = mp.get_context("spawn").Process(
            target=run_engine_core, args=(config, in_addr, out_addr, log_level), name="siesta-engine", daemon=True
        )
        with _memory_saver_hook(config):
            self.process.start()
        self.dead: str | None = None
        ready = self._wait_ready()
        self.info, self.state = ready.info, ready.state

    def _wait_ready(self) -> Ready:
        waited = 0.0
        while waited < STARTUP_TIMEOUT_S:
            msg = self.recv(timeout_ms=POLL_MS)
            if isinstance(msg, Ready):
                return msg
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
        if self.dead is None and not self.process.is_alive():
            self.dead = f"engine process exited with code {self.process.exitcode}"
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
        if self.process.is_alive():
            try:
                self._to_core.send(self._encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(SHUTDOWN_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self._to_core.close()
        self._from_core.close()
        self._ctx.term()
        for name in ("to_core", "from_core"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)


def reply_result(reply: ControlReply, reply_type: Any) -> Any:
    """A control reply's result, decoded as its call's `reply` type; a failure raises the
    engine's error type for it (engine/errors.py)."""
    if reply.error is not None:
        raise from_kind(reply.error.kind, reply.error.message)
    return msgspec.msgpack.decode(reply.result, type=reply_type)
