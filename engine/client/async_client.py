"""`AsyncEngineClient`: the server's client of the engine process, inside its asyncio loop.

One reader task routes the core's messages: it applies each token delta to its request's state
(detokenization, stop strings, logprobs) at once, and control replies go to the future of their
call. A request's consumer is woken once per batch of updates, not once per delta: a stream that
reads slowly gets the updates merged, and a whole (non-streamed) response wakes only at its end
and, without stop strings, is detokenized once there. A watchdog notices a dead core and fails
everything waiting on it with `EngineDeadError`, so no HTTP request hangs on a dead engine.

Rules of the per-token path (it runs for every request on every step):
- A request's consumer is anything with `set()`, called on each change; several requests may
  share one (all the samples of a stream). `Waker` wakes a task that waits on it; a push
  consumer (a stream response) instead asks, with `after_drain`, to be called back once the
  reader has applied every message queued so far, and sends its events from there, in the
  reader: no task switch per event, and one event per drain however many steps it applied.
- The consumer `take`s what changed since its last take, straight from the request's output.
- `open` registers a request, `submit` sends it (several in one message), `updates` yields a
  `Waker`'s updates, `close` forgets it and aborts it in the engine if it has not finished: a
  consumer that stops early (its HTTP client went away) must close.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq

from engine.client.core_process import CoreLink, CoreProcess, reply_result
from engine.client.output import (
    Consumer,
    GenerationOutput,
    LiveRequest,
    RequestState,
    StepUpdate,
    Waker,
)
from engine.config import EngineConfig
from engine.core.availability import EngineState
from engine.core.calls import Abort, Call
from engine.core.protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    ControlReply,
    StateUpdate,
    StepOutputs,
    ToCore,
)
from engine.errors import EngineDeadError, InvalidRequest
from engine.request import SamplingParams

log = logging.getLogger("siesta.client")

# How often the watchdog looks at the engine process, seconds.
WATCHDOG_PERIOD_S = 0.2
# The reader calls its push consumers back once the queued engine messages are applied, or after
# this many in a row: a reader that the engine outruns still sends every MAX_DRAIN steps.
MAX_DRAIN = 32


def _ignore_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _load_tokenizer(config: EngineConfig) -> Any:
    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
    log.info("tokenizer loaded in %.1f s (transformers imported)", time.perf_counter() - t0)
    return tokenizer


class AsyncEngineClient:
    def __init__(
        self, config: EngineConfig, log_level: str = "INFO", num_clients: int = 1, link: CoreLink | None = None
    ) -> None:
        """Start the engine process with room for `num_clients` clients (API server processes), or
        with `link` use one another process started, and wait until it is ready (blocking: call
        before serving)."""
        self.config = config
        self._core = link if link is not None else CoreProcess(config, log_level=log_level, num_clients=num_clients)
        try:  # while the engine process starts
            self.tokenizer = _load_tokenizer(config)
            if link is None:
                self._core.wait_ready()
        except BaseException:
            self._core.close()
            raise
        self.info = self._core.info
        self._live: dict[str, LiveRequest] = {}
        self._calls: dict[int, tuple[asyncio.Future[Any], Any]] = {}  # call id -> (future, reply type)
        self._call_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._after_drain: list[Callable[[], None]] = []
        # Whether the engine serves, as of its last control reply (engine/core/availability.py).
        self.state: EngineState = self._core.state

    @property
    def pid(self) -> int | None:
        return self._core.pid

    @property
    def pipes(self) -> list[tuple[str, str]]:
        """Every client's socket addresses, when this client started the engine (else its own)."""
        return self._core.pipes

    @property
    def dead(self) -> str | None:
        return self._core.dead

    async def start(self) -> None:
        """Start the reader and the watchdog in the running loop. What the server has loaded by
        now (torch, transformers, the tokenizer: a few hundred thousand objects) lives as long as
        it does: frozen, the collector's full passes skip it (each took 0.1-0.2 s, every few
        thousand streamed tokens, stalling every stream)."""
        gc.collect()
        gc.freeze()
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
        sock = self._from_core
        applied = 0  # messages since the consumers were last called back
        while self.dead is None:
            msg = self._core.decode(await sock.recv())
            applied += 1
            if isinstance(msg, StepOutputs):
                await self._apply(msg)
            elif isinstance(msg, ControlReply):
                self._on_reply(msg)
            elif isinstance(msg, StateUpdate):
                self._on_state(msg.state)
            if self._after_drain and (applied >= MAX_DRAIN or not sock.get(zmq.EVENTS) & zmq.POLLIN):
                applied = 0
                self._run_after_drain()
        self._fail_all()

    def _on_reply(self, reply: ControlReply) -> None:
        """Take the engine's state from a control reply, then resolve its call."""
        self._on_state(reply.state)
        fut, reply_type = self._calls.pop(reply.call_id, (None, None))
        if fut is None or fut.done():
            return
        try:
            fut.set_result(reply_result(reply, reply_type))
        except Exception as e:
            fut.set_exception(e)

    def _on_state(self, state: EngineState) -> None:
        self.state = state
        self.info["weight_version"] = state.weight_version

    def after_drain(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the reader has applied every engine message queued by then (or at
        once if the engine is found dead). It runs in the reader: it must not block or raise."""
        self._after_drain.append(callback)

    def _run_after_drain(self) -> None:
        callbacks, self._after_drain = self._after_drain, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a consumer's bug must not stop the reader
                log.exception("a stream failed while sending its events")

    async def _apply(self, msg: StepOutputs) -> None:
        """Apply a step's deltas to their requests; wake the consumers that have something."""
        stopped: list[str] = []  # a stop string matched here: the core must stop the request
        live_requests = self._live
        for delta in msg.deltas:
            live = live_requests.get(delta.request_id)
            if live is None:
                continue
            update = live.state.apply(delta)
            if live.on_tokens is not None and update.token_ids:
                live.on_tokens(len(update.token_ids))
            if update.abort:
                stopped.append(delta.request_id)
            if live.every_step or update.finished:
                live.ready = True
                live.waker.set()
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
            live.waker.set()
        for fut, _ in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        self._run_after_drain()

    # ---- generation -----------------------------------------------------------------------------

    def open(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, every_step: bool, waker: Consumer,
        on_tokens: Callable[[int], None] | None = None,
    ) -> LiveRequest:
        """Register a request (not sent yet: `submit`); its updates will wake `waker`: per engine
        step with `every_step`, else only at its end. The caller must `close` it."""
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        # A whole response without stop strings needs its text only at the end: decode once there.
        incremental = every_step or bool(params.stop)
        state = RequestState(request_id, prompt_token_ids, params, self.tokenizer, incremental=incremental,
                             routes_dtype=self.config.routed_experts_dtype)  # fmt: skip
        live = self._live[request_id] = LiveRequest(state, every_step, waker, on_tokens)
        return live

    async def submit(self, *lives: LiveRequest) -> None:
        """Send opened requests to the engine, several in one message (`AddRequests`): the engine
        adds them all before its next step (none: nothing is sent)."""
        if not lives:
            return
        adds = [
            AddRequest(request_id=live.request_id, prompt_token_ids=live.state.output.prompt_token_ids,
                       sampling_params=live.state.params)
            for live in lives
        ]  # fmt: skip
        await self._send(adds[0] if len(adds) == 1 else AddRequests(requests=adds))

    def close(self, live: LiveRequest) -> None:
        """Forget a request; abort it in the engine if it has not finished (never blocks)."""
        rid = live.request_id
        if self._live.get(rid) is live:
            del self._live[rid]
        if not live.state.output.finished and self.dead is None:
            sent = self._to_core.send(self._core.encode(AbortRequests(request_ids=[rid])), flags=zmq.NOBLOCK)
            sent.add_done_callback(_ignore_outcome)  # zmq.Again, a full queue: the engine is stuck anyway

    async def updates(self, live: LiveRequest) -> AsyncIterator[tuple[StepUpdate, GenerationOutput]]:
        """Yield (what changed, the output so far) of a submitted request opened with a `Waker`
        until it finishes: per engine step, or per batch of steps when the consumer is slower than
        the engine; opened without `every_step`, once, at the end. The caller closes it (a close
        before its end, a client that went away, aborts it in the engine)."""
        waker = live.waker
        assert isinstance(waker, Waker), "a push consumer is called back, it does not wait"
        finished = False
        while not finished:
            await waker.wait()
            if live.error is not None:
                raise live.error
            if not live.ready:
                continue
            update = live.take()
            finished = update.finished
            yield update, live.state.output

    async def abort(self, rid: str | None) -> int:
        """Abort a request and its samples (sent with n > 1), whichever API server process it came
        through, or every request when `rid` is None; returns how many the engine found."""
        self.check_alive()
        return await self.call(Abort(request_ids=None if rid is None else [rid], samples=True))

    # ---- control --------------------------------------------------------------------------------

    @property
    def unavailable(self) -> str | None:
        """Why new requests cannot run now (HTTP 503), as the engine said in its last reply."""
        return self.state.unavailable

    async def call(self, call: Call, timeout: float | None = None) -> Any:
        """Run a control call between steps; its result (`call.reply`); a failure raises the
        engine's error type for it (engine/errors.py)."""
        call = msgspec.structs.replace(call, call_id=next(self._call_ids))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call.call_id] = (fut, call.reply)
        try:
            await asyncio.wait_for(self._send(call), timeout)
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call.call_id, None)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._core.close()
