"""`AsyncEngineClient`: the server's client of the engine process, inside its asyncio loop.

One reader task routes the core's messages: it applies each token delta to its request's state
(detokenization, stop strings, logprobs) at once, and control replies go to the future of their
call. A request's consumer is woken once per batch of updates, not once per delta: a stream that
reads slowly gets the updates merged, and a whole (non-streamed) response wakes only at its end
and, without stop strings, is detokenized once there. A watchdog notices a dead core and fails
everything waiting on it with `EngineDeadError`, so no HTTP request hangs on a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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


@dataclass(eq=False)
class LiveRequest:
    """A request in flight as the reader sees it: its state, the updates its consumer has not
    taken yet, and the event that wakes the consumer."""

    state: RequestState
    every_step: bool  # wake per step (streams); else only at the end
    on_tokens: Callable[[int], None] | None = None  # told each step's new token count (metrics)
    updates: list[StepUpdate] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    error: EngineDeadError | None = None

    def take(self) -> StepUpdate:
        """Every update since the last take, merged into one."""
        updates, self.updates = self.updates, []
        if len(updates) == 1:
            return updates[0]
        return StepUpdate(text="".join(u.text for u in updates), token_ids=[t for u in updates for t in u.token_ids],
                          finished=any(u.finished for u in updates))


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        """Start the engine process and wait until it is ready (blocking: call before serving)."""
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self._core = CoreProcess(config, log_level=log_level)
        self.info = self._core.info
        self._live: dict[str, LiveRequest] = {}
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
                await self._apply(msg)
            elif isinstance(msg, ControlReply):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    if msg.ok:
                        fut.set_result(msg.result)
                    else:
                        fut.set_exception(control_error(msg))
        self._fail_all()

    async def _apply(self, msg: StepOutputs) -> None:
        """Apply a step's deltas to their requests; wake the consumers that have something."""
        stopped: list[str] = []  # a stop string matched here: the core must stop the request
        for delta in msg.deltas:
            live = self._live.get(delta.request_id)
            if live is None:
                continue
            update = live.state.apply(delta)
            if live.on_tokens is not None and update.token_ids:
                live.on_tokens(len(update.token_ids))
            if update.abort:
                stopped.append(delta.request_id)
            if live.every_step or update.finished:
                live.updates.append(update)
                live.wake.set()
        if stopped:
            await self._send(AbortRequests(request_ids=stopped))

    async def _watchdog(self) -> None:
        while self._core.check_alive():
            await asyncio.sleep(WATCHDOG_PERIOD_S)
        log.error("engine process is dead: %s", self.dead)
        self._fail_all()
        self.died.set()

    def _fail_all(self) -> None:
        err = EngineDeadError(self.dead or "engine is dead")
        for live in self._live.values():
            live.error = err
            live.wake.set()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()

    # ---- generation -----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, every_step: bool = True,
        on_tokens: Callable[[int], None] | None = None,
    ) -> AsyncIterator[tuple[StepUpdate, GenerationOutput]]:
        """Yield (what changed, the output so far) until the request finishes: per engine step, or
        per batch of steps when the consumer is slower than the engine; with `every_step` False,
        once, at the end. Closing the iterator early (a client that went away) aborts the request
        in the engine."""
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        # A whole response without stop strings needs its text only at the end: decode once there.
        incremental = every_step or bool(params.stop)
        state = RequestState(request_id, prompt_token_ids, params, self.tokenizer, incremental=incremental)
        live = LiveRequest(state, every_step, on_tokens)
        self._live[request_id] = live
        finished = False
        try:
            await self._send(AddRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params))
            while not finished:
                await live.wake.wait()
                live.wake.clear()
                if live.error is not None:
                    raise live.error
                update = live.take()
                finished = update.finished
                yield update, state.output
        finally:
            del self._live[request_id]
            if not finished and self.dead is None:
                with contextlib.suppress(zmq.Again):  # a full queue: the engine is stuck anyway
                    await self._to_core.send(self._core.encode(AbortRequests(request_ids=[request_id])), flags=zmq.NOBLOCK)

    def active_ids(self, rid: str) -> list[str]:
        """The engine ids of `rid`: itself and its samples when it was sent with n > 1."""
        prefix = rid + SAMPLE_SEP
        return [i for i in self._live if i == rid or i.startswith(prefix)]

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
