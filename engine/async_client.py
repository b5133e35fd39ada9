"""`AsyncEngineClient`: the server's client of the engine process, inside its asyncio loop.

One reader task routes the core's messages: token deltas to the queue of their request, control
replies to the future of their call. A watchdog notices a dead core and fails everything waiting
on it with `EngineDeadError`, so no HTTP request hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.core_process import CoreProcess, EngineDeadError
from engine.output import GenerationOutput, RequestState, StepUpdate
from engine.protocol import (
    AbortRequests,
    AddRequest,
    ControlCall,
    ControlReply,
    RequestDelta,
    StepOutputs,
    ToCore,
)
from engine.request import InvalidRequest, SamplingParams

log = logging.getLogger("siesta.client")

# How often the watchdog looks at the engine process, seconds.
WATCHDOG_PERIOD_S = 0.2
# Sample i of a request with n > 1 has id f"{rid}{SAMPLE_SEP}{i}"; aborting rid aborts them all.
SAMPLE_SEP = "#"


def control_error(reply: ControlReply) -> Exception:
    """The exception a refused control call raises: PermissionError (403) or InvalidRequest (400)."""
    if reply.error_kind == "PermissionError":
        return PermissionError(reply.error)
    return InvalidRequest(reply.error)


class EngineUnavailable(RuntimeError):
    """The engine is alive but cannot serve now (memory released, weights to update): HTTP 503."""


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        """Start the engine process and wait until it is ready (blocking: call before serving)."""
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self._core = CoreProcess(config, log_level=log_level)
        self.info = self._core.info
        self._queues: dict[str, asyncio.Queue[RequestDelta | EngineDeadError]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        # Why requests cannot run now (memory released, ...), as the last memory call answered.
        self.unavailable: str | None = None

    @property
    def pid(self) -> int | None:
        return self._core.process.pid

    @property
    def dead(self) -> str | None:
        return self._core.dead

    async def start(self) -> None:
        """Start the reader and the watchdog in the running loop."""
        self._to_core, self._from_core = self._core.async_sockets()
        self.died = asyncio.Event()  # set once the engine process is found dead
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watchdog())]

    def check_alive(self) -> None:
        """Raise `EngineDeadError` at once if the engine process has died (a cheap waitpid), so no
        caller waits for the watchdog's next look."""
        if not self._core.check_alive():
            self._fail_all()
            self.died.set()
            raise EngineDeadError(self.dead)

    async def _send(self, msg: ToCore) -> None:
        """Send without ever blocking on a dead engine: a PUSH socket whose peer is gone (or full)
        would wait forever, so a send that cannot go at once races the engine's death."""
        self.check_alive()
        data = self._core.encode(msg)
        try:
            await self._to_core.send(data, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        sending = asyncio.ensure_future(self._to_core.send(data))
        death = asyncio.ensure_future(self.died.wait())
        try:
            await asyncio.wait({sending, death}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            death.cancel()
            if not sending.done():
                sending.cancel()
        if not sending.done() or sending.cancelled():
            raise EngineDeadError(self.dead or "engine is dead")
        sending.result()

    async def _read_loop(self) -> None:
        while self.dead is None:
            msg = self._core.decode(await self._from_core.recv())
            if isinstance(msg, StepOutputs):
                for delta in msg.deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
            elif isinstance(msg, ControlReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.ok:
                        fut.set_result(msg.result)
                    else:
                        fut.set_exception(control_error(msg))
        self._fail_all()

    async def _watchdog(self) -> None:
        while self._core.check_alive():
            await asyncio.sleep(WATCHDOG_PERIOD_S)
        log.error("engine process is dead: %s", self.dead)
        self._fail_all()
        self.died.set()

    def _fail_all(self) -> None:
        err = EngineDeadError(self.dead or "engine is dead")
        for queue in self._queues.values():
            queue.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()

    # ---- generation -----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[tuple[StepUpdate, GenerationOutput]]:
        """Yield (what changed, the output so far) per engine step until the request finishes.
        Closing the iterator early (a client that went away) aborts the request in the engine."""
        self.check_alive()
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        state = RequestState(request_id, prompt_token_ids, params, self.tokenizer)
        queue: asyncio.Queue[RequestDelta | EngineDeadError] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params))
            while not finished:
                item = await queue.get()
                if isinstance(item, EngineDeadError):
                    raise item
                update = state.apply(item)
                finished = update.finished
                if update.abort:
                    await self._send(AbortRequests(request_ids=[request_id]))
                yield update, state.output
        finally:
            del self._queues[request_id]
            if not finished and self.dead is None:
                with contextlib.suppress(zmq.Again):  # a full queue: the engine is stuck anyway
                    await self._to_core.send(self._core.encode(AbortRequests(request_ids=[request_id])), flags=zmq.NOBLOCK)

    def active_ids(self, rid: str) -> list[str]:
        """The engine ids of `rid`: itself and its samples when it was sent with n > 1."""
        prefix = rid + SAMPLE_SEP
        return [i for i in self._queues if i == rid or i.startswith(prefix)]

    async def abort(self, rid: str | None) -> int:
        """Abort a request (and its samples), or every request when `rid` is None; returns how
        many the engine found."""
        self.check_alive()
        ids = None if rid is None else self.active_ids(rid)
        if ids == []:
            return 0
        return await self.call("abort_requests", request_ids=ids)

    # ---- control --------------------------------------------------------------------------------

    async def call(self, method: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run a control method of the core between steps; its result; a refusal raises InvalidRequest."""
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await asyncio.wait_for(self._send(ControlCall(call_id=call_id, method=method, kwargs=kwargs)), timeout)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def memory_call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        """A memory or weight-update call; keeps `unavailable` and the weight version in step with
        the engine, so generate routes can answer 503 before they start a stream."""
        answer = await self.call(method, **kwargs)
        state = await self.call("memory_occupation")
        released = [t for t, v in state["tags"].items() if v["state"] == "released"]
        if released:
            self.unavailable = f"memory is released ({', '.join(released)}): resume_memory_occupation first"
        elif not state["weights_valid"]:
            self.unavailable = "weights were released without a host copy (--weights-backup none): update the weights first"
        else:
            self.unavailable = None
        if "weight_version" in answer:
            self.info["weight_version"] = answer["weight_version"]
        return answer

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._core.close()
