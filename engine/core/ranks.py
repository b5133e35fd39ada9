"""`Ranks`: every tensor-parallel rank as rank 0 drives it: its own `Rank` and, at tp_size > 1,
one worker process per other rank (engine/core/worker.py), each on its own device.

Startup (`Ranks.start`, then `attach`): rank 0 hosts the group's rendezvous store (bound before
the workers start: engine/parallel.py `host_rendezvous`), binds one ZeroMQ PUSH socket per worker
and one PULL socket for their replies, spawns the workers, and joins the tensor-parallel group
with them; every rank then builds its `Rank` in step (their startup forwards and graph
captures run collectives), and each worker says `RankReady`.

Rules:
- `send_step` hands a planned step to every worker and returns: the step's collectives keep the
  ranks in step, and rank 0 alone reads tokens back.
- `run` sends a message to every worker, runs it on rank 0, then waits for every worker's reply:
  a call answers after every rank has finished. The first failure is raised (rank order).
- A worker that exits takes the engine down: a watchdog thread waits on the workers' process
  sentinels, tells the client why (`Failed`, through its own socket) and ends rank 0, whatever it
  is blocked in (a collective with a dead peer never returns). The workers end themselves when
  rank 0 is gone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import rank_protocol as rp
from engine.core.protocol import Failed
from engine.core.rank import Rank
from engine.errors import from_kind
from engine.parallel import host_rendezvous
from engine.runner.step_plan import StepPlan

log = logging.getLogger("siesta.engine")

# How long rank 0 waits for the workers to stop before it kills them, seconds.
STOP_TIMEOUT_S = 10.0
# How often the watchdog looks at the workers, seconds.
WATCH_S = 0.2


def _socket_dir(client_addrs: list[str]) -> str | None:
    """The directory of the clients' IPC sockets (None: the system's temporary one). The ranks'
    sockets go in it, so the client that made it removes them with its own, even after this
    process was killed (engine/client/core_process.py `CoreProcess.close`)."""
    paths = [a.removeprefix("ipc://") for a in client_addrs if a.startswith("ipc://")]
    return os.path.dirname(paths[0]) if paths else None


class Ranks:
    def __init__(self, size: int) -> None:
        self.size = size
        self.local: Rank | None = None
        # Where the ranks meet to form the group (none needed at size 1): rank 0 hosts the store.
        self.store = host_rendezvous(size) if size > 1 else None
        self.init_method = f"tcp://127.0.0.1:{self.store.port}" if self.store is not None else ""
        self._procs: list[subprocess.Popen] = []
        self._to: list[zmq.Socket] = []
        self._stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(rp.FromRank)

    @classmethod
    def start(cls, config: EngineConfig, log_level: str = "INFO", client_addrs: list[str] | None = None) -> Ranks:
        """Spawn the workers of ranks 1 .. tp_size - 1 (none at tp_size 1); `client_addrs` are where
        the watchdog reports a dead worker (every client's from-core socket)."""
        ranks = cls(config.tp_size)
        if ranks.size == 1:
            return ranks
        client_addrs = client_addrs or []
        ranks._dir = tempfile.mkdtemp(prefix="siesta-tp-", dir=_socket_dir(client_addrs))
        ranks._ctx = zmq.Context()
        ranks._from = ranks._ctx.socket(zmq.PULL)
        from_addr = f"ipc://{os.path.join(ranks._dir, 'from_ranks')}"
        ranks._from.bind(from_addr)
        config_json = msgspec.json.encode(config).decode()
        for r in range(1, ranks.size):
            to = ranks._ctx.socket(zmq.PUSH)
            to.setsockopt(zmq.LINGER, 0)
            to_addr = f"ipc://{os.path.join(ranks._dir, f'to_rank{r}')}"
            to.bind(to_addr)
            ranks._to.append(to)
            # A plain subprocess (the engine process is a daemon, which multiprocessing forbids
            # children); it inherits the environment, torch_memory_saver's preload hook included.
            argv = [sys.executable, "-m", "engine.core.worker", str(r), str(ranks.size), ranks.init_method,
                    to_addr, from_addr, log_level, config_json]
            ranks._procs.append(subprocess.Popen(argv))
        threading.Thread(target=ranks._watch, args=(client_addrs,), name="siesta-rank-watchdog", daemon=True).start()
        return ranks

    @property
    def pids(self) -> list[int]:
        """The worker processes of ranks 1 .. size - 1."""
        return [p.pid for p in self._procs]

    def attach(self, local: Rank) -> None:
        """Rank 0's own `Rank` is built: wait until every worker has built its own."""
        self.local = local
        if self.size == 1:
            return
        local.runner.fan_out = self.send_step
        ready: set[int] = set()
        while len(ready) < self.size - 1:
            msg = self._decoder.decode(self._from.recv())
            if isinstance(msg, rp.RankFailed):
                raise RuntimeError(f"tensor-parallel rank {msg.rank} failed to start: {msg.error}")
            if isinstance(msg, rp.RankReady):
                ready.add(msg.rank)
        log.info("tensor parallelism: %d ranks ready", self.size)

    # ---- messages ---------------------------------------------------------------------------------

    def send_step(self, plan: StepPlan) -> None:
        self._post(rp.RunStep(plan))

    def _post(self, msg: rp.ToRank) -> None:
        data = self._encoder.encode(msg)
        for to in self._to:
            to.send(data)

    def after_reply(self) -> None:
        """Each rank's work for after a call's answer (no reply awaited)."""
        self._post(rp.AfterReply())
        assert self.local is not None
        self.local.after_reply()

    def run(self, msg: rp.ToRank) -> list[Any]:
        """`msg` on every rank, rank 0's result first; raises the first rank's failure, once every
        rank has answered."""
        assert self.local is not None
        self._post(msg)
        results: list[Any] = [None] * self.size
        errors: dict[int, Exception] = {}
        try:
            results[0] = self.local.handle(msg)
        except Exception as e:  # reported once the others have answered
            errors[0] = e
        answered = 0
        while answered < self.size - 1:
            reply = self._decoder.decode(self._from.recv())
            if not isinstance(reply, rp.RankReply):
                continue
            answered += 1
            if reply.error is not None:
                errors[reply.rank] = from_kind(reply.error.kind, f"tensor-parallel rank {reply.rank}: {reply.error.message}")
            results[reply.rank] = reply.result
        if errors:
            first = errors.pop(min(errors))
            errors.clear()
            try:
                raise first
            finally:  # no frame of the traceback keeps it: that cycle would outlive the answer
                del first
        return results

    # ---- the workers' lives -----------------------------------------------------------------------

    def death(self, wait_s: float = 1.0) -> str | None:
        """Why the engine died when a worker did (a collective with it failed first), else None."""
        deadline = time.monotonic() + wait_s
        while self._procs:
            for r, p in enumerate(self._procs, start=1):
                if p.poll() is not None:
                    return f"tensor-parallel rank {r} exited with code {p.returncode}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return None

    def _watch(self, client_addrs: list[str]) -> None:
        while True:
            codes = [p.poll() for p in self._procs]
            if self._stopping:
                return
            if any(c is not None for c in codes):
                break
            time.sleep(WATCH_S)
        rank, code = next((r, c) for r, c in enumerate(codes, start=1) if c is not None)
        error = f"engine died: tensor-parallel rank {rank} exited with code {code}"
        log.error("%s; rank 0 exits", error)
        ctx = zmq.Context()
        for addr in client_addrs:
            out = ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 2000)
            out.connect(addr)
            out.send(msgspec.msgpack.encode(Failed(error=error)))
            out.close()
        ctx.term()
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        os._exit(1)

    def close(self) -> None:
        """Stop the workers (killed after STOP_TIMEOUT_S)."""
        if self.size == 1 or self._stopping:
            return
        self._stopping = True
        try:
            self._post(rp.StopRank())
        except zmq.ZMQError:
            pass
        for p in self._procs:
            try:
                p.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in (*self._to, self._from):
            s.close()
        self._ctx.term()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
