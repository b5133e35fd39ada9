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
from engine.core.deferred import Deferred
from engine.core.engine_core import EngineCore
from engine.core.protocol import (
    AbortRequests,
    AddRequest,
    ControlCall,
    ControlReply,
    Failed,
    FromCore,
    Ready,
    RequestDelta,
    Shutdown,
    StepOutputs,
    ToCore,
)

log = logging.getLogger("siesta.engine")

# How long the idle loop blocks on its socket before it looks at its parent again, ms.
_IDLE_POLL_MS = 100


def run_engine_core(config: EngineConfig, in_addr: str, out_addr: str, log_level: str = "INFO") -> None:
    """Entry point of the engine process: build the core, say Ready (or Failed), serve until told
    to stop or until the parent process is gone."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToCore)

    def send(msg: FromCore) -> None:
        outbox.send(encoder.encode(msg))

    try:
        core = EngineCore(config)
    except Exception as e:  # the client raises this text; the process exits non-zero
        send(Failed(error=f"{type(e).__name__}: {e}"))
        log.error("engine core failed to start:\n%s", traceback.format_exc())
        outbox.close()
        ctx.term()
        raise SystemExit(1) from None
    send(Ready(info=core.get_info()))
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
                msg = decoder.decode(inbox.recv())
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
        send(Failed(error=f"engine core died: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    finally:
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
    if isinstance(msg, ControlCall):
        try:
            result = core.call(msg.method, msg.kwargs)
        except Exception as e:  # a bad control call is the caller's error, not the engine's death
            _reply(core, send, _failure(msg.call_id, e))
            return []
        if isinstance(result, Deferred):
            _send_pending(core, send)
            waiting_calls.append((msg.call_id, result))
        else:
            _reply(core, send, ControlReply(call_id=msg.call_id, ok=True, result=result))
    return []


def _answer_ready(core: EngineCore, waiting_calls: list[tuple[int, Deferred]], send: Any) -> None:
    """Answer, in order of arrival, the waiting calls that are ready now."""
    while waiting_calls and waiting_calls[0][1].ready():
        call_id, deferred = waiting_calls.pop(0)
        core.pending += core.drain()  # as every control call: it runs with no step in flight
        try:
            reply = ControlReply(call_id=call_id, ok=True, result=deferred.run())
        except Exception as e:
            reply = _failure(call_id, e)
        _reply(core, send, reply)


def _failure(call_id: int, e: Exception) -> ControlReply:
    return ControlReply(call_id=call_id, ok=False, error=f"{type(e).__name__}: {e}", error_kind=type(e).__name__)


def _reply(core: EngineCore, send: Any, reply: ControlReply) -> None:
    _send_pending(core, send)
    send(reply)
    core.after_reply()  # work a call left for after its answer (a weight update's host copy)


def _send_pending(core: EngineCore, send: Any) -> None:
    deltas = core.take_pending()
    if deltas:
        send(StepOutputs(deltas=deltas))
