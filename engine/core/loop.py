"""The engine process's main loop: build the `EngineCore`, say Ready (or Failed), then take
messages and run steps until told to stop or until the parent process is gone. Control calls that
cannot answer at once (a release that waits for running requests) answer when they are ready.
"""

from __future__ import annotations

import gc
import logging
import os
import traceback
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.calls import Call
from engine.core.deferred import Deferred
from engine.core.engine_core import EngineCore
from engine.core.protocol import (
    AbortRequests,
    AddRequest,
    ControlError,
    ControlReply,
    Failed,
    FromCore,
    Ready,
    RequestDelta,
    Shutdown,
    StepOutputs,
    ToCore,
    connect_pipes,
)
from engine.errors import error_kind

log = logging.getLogger("siesta.engine")

# How long the idle loop blocks on its socket before it looks at its parent again, ms.
_IDLE_POLL_MS = 100


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the engine process: build the core, say Ready (or Failed), serve until told
    to stop or until the parent process is gone."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    ctx, inbox, outbox = connect_pipes(in_addr, out_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToCore)

    def send(msg: FromCore) -> None:
        outbox.send(encoder.encode(msg))

    try:
        core = EngineCore(config, log_level, out_addr)
    except Exception as e:  # the client raises this text; the process exits non-zero
        send(Failed(error=f"{type(e).__name__}: {e}"))
        log.error("engine core failed to start:\n%s", traceback.format_exc())
        outbox.close()
        ctx.term()
        raise SystemExit(1) from None
    send(Ready(info=core.get_info(), state=core.availability.state()))
    # What startup built (model, tokenizer, graphs) lives as long as the process: frozen, the
    # collector's full passes skip it instead of stalling the step loop to scan it (as vLLM does).
    gc.collect()
    gc.freeze()

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    waiting_calls: list[tuple[int, Deferred]] = []  # control calls that answer once ready
    try:
        while True:
            _answer_ready(core, waiting_calls, send)
            timeout = 0 if core.has_work() else _IDLE_POLL_MS
            while poller.poll(timeout):
                try:
                    msg = decoder.decode(inbox.recv())
                except msgspec.ValidationError as e:  # a client's bug: its call goes unanswered
                    log.error("dropped a message the engine cannot read: %s", e)
                    continue
                if isinstance(msg, Shutdown):
                    return
                deltas = _handle(core, msg, send, waiting_calls)
                if deltas:
                    send(StepOutputs(deltas=deltas))
                timeout = 0
                _answer_ready(core, waiting_calls, send)
            if core.has_work():
                deltas = core.step()
                if deltas:
                    send(StepOutputs(deltas=deltas))
            elif os.getppid() != parent:
                log.warning("parent process is gone; engine core exits")
                return
    except Exception as e:
        log.error("engine core died:\n%s", traceback.format_exc())
        send(Failed(error=f"engine core died: {core.ranks.death() or f'{type(e).__name__}: {e}'}"))
        raise SystemExit(1) from None
    finally:
        core.close()
        inbox.close()
        outbox.close()
        ctx.term()


def _handle(core: EngineCore, msg: ToCore, send: Any, waiting_calls: list[tuple[int, Deferred]]) -> list[RequestDelta]:
    """Apply one message; return the deltas it produced. A control call's own deltas (aborts) are
    sent before its reply, so a caller that sees the reply has seen them too. A call that answers
    later joins `waiting_calls`."""
    if isinstance(msg, AddRequest):
        delta = core.add_request(msg)
        return [delta] if delta is not None else []
    if isinstance(msg, AbortRequests):
        return core.abort(msg.request_ids)
    if isinstance(msg, Call):
        try:
            result = core.call(msg)
        except Exception as e:  # a failed control call is the caller's, not the engine's death
            _reply(core, send, msg.call_id, error=e)
            return []
        if isinstance(result, Deferred):
            _send_pending(core, send)
            waiting_calls.append((msg.call_id, result))
        else:
            _reply(core, send, msg.call_id, result)
    return []


def _answer_ready(core: EngineCore, waiting_calls: list[tuple[int, Deferred]], send: Any) -> None:
    """Answer, in order of arrival, the waiting calls that are ready now."""
    while waiting_calls and waiting_calls[0][1].ready():
        call_id, deferred = waiting_calls.pop(0)
        core.pending += core.drain()  # as every control call: it runs with no step in flight
        try:
            result = deferred.run()
        except Exception as e:
            _reply(core, send, call_id, error=e)
        else:
            _reply(core, send, call_id, result)


_RESULTS = msgspec.msgpack.Encoder()
_NULL = msgspec.Raw(_RESULTS.encode(None))
# A failure of these types is an expected refusal; any other is logged with its traceback.
_REFUSALS = (ValueError, TypeError, LookupError, TimeoutError, PermissionError)


def _reply(core: EngineCore, send: Any, call_id: int, result: Any = None, error: Exception | None = None) -> None:
    """Answer a control call with its result or its failure, and the engine's state after it."""
    _send_pending(core, send)
    if error is None:
        send(ControlReply(call_id=call_id, state=core.availability.state(), result=msgspec.Raw(_RESULTS.encode(result))))
    else:
        if not isinstance(error, _REFUSALS):
            log.error("control call %d failed:\n%s", call_id, "".join(traceback.format_exception(error)))
        failure = ControlError(kind=error_kind(error), message=f"{type(error).__name__}: {error}")
        send(ControlReply(call_id=call_id, state=core.availability.state(), result=_NULL, error=failure))
    core.after_reply()  # work a call left for after its answer (a weight update's host copy)


def _send_pending(core: EngineCore, send: Any) -> None:
    deltas = core.take_pending()
    if deltas:
        send(StepOutputs(deltas=deltas))
