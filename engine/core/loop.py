"""The engine process's main loop: build the `EngineCore`, say Ready (or Failed), then take
messages and run steps until told to stop or until the parent process is gone. Control calls that
cannot answer at once (a release that waits for running requests) answer when they are ready.
"""

from __future__ import annotations

import gc
import logging
import os
import traceback
from collections.abc import Callable
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core.calls import Call
from engine.core.client_pipes import ClientPipes
from engine.core.deferred import Deferred
from engine.core.engine_core import EngineCore
from engine.core.protocol import (
    AbortRequests,
    AddRequest,
    AddRequests,
    ControlError,
    ControlReply,
    Failed,
    Ready,
    Shutdown,
    StepOutputs,
    ToCore,
)
from engine.errors import error_kind

log = logging.getLogger("siesta.engine")

# How long the idle loop blocks on its socket before it looks at its parent again, ms.
_IDLE_POLL_MS = 100


def run_engine_core(config: EngineConfig, pipes: list[tuple[str, str]], log_level: str = "INFO") -> None:
    """Entry point of the engine process: build the core, say Ready (or Failed) to every client
    (`pipes`: each one's socket addresses, engine/core/client_pipes.py), serve until told to stop
    or until the parent process is gone."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    clients = ClientPipes(pipes)
    try:
        core = EngineCore(config, log_level, [out_addr for _, out_addr in pipes])
    except Exception as e:  # the client raises this text; the process exits non-zero
        clients.broadcast(Failed(error=f"{type(e).__name__}: {e}"))
        log.error("engine core failed to start:\n%s", traceback.format_exc())
        clients.close()
        raise SystemExit(1) from None
    clients.broadcast(Ready(info=core.get_info(), state=core.availability.state()))
    # What startup built (model, tokenizer, graphs) lives as long as the process: frozen, the
    # collector's full passes skip it instead of stalling the step loop to scan it (as vLLM does).
    gc.collect()
    gc.freeze()

    waiting_calls: list[tuple[int, int, Deferred]] = []  # (client, call id, call) answered once ready
    try:
        while True:
            _answer_ready(core, clients, waiting_calls)
            timeout = 0 if core.has_work() else _IDLE_POLL_MS
            while messages := clients.poll(timeout):
                for client, data in messages:
                    try:
                        msg = clients.decode(data)
                    except msgspec.ValidationError as e:  # a client's bug: its call goes unanswered
                        log.error("dropped a message the engine cannot read: %s", e)
                        continue
                    if isinstance(msg, Shutdown):
                        return
                    _handle(core, clients, client, msg, waiting_calls)
                    _answer_ready(core, clients, waiting_calls)
                timeout = 0
            if core.has_work():
                clients.route(core.step())
            elif os.getppid() != parent:
                log.warning("parent process is gone; engine core exits")
                return
    except Exception as e:
        log.error("engine core died:\n%s", traceback.format_exc())
        clients.broadcast(Failed(error=f"engine core died: {core.ranks.death() or f'{type(e).__name__}: {e}'}"))
        raise SystemExit(1) from None
    finally:
        core.close()
        clients.close()


def _handle(
    core: EngineCore, clients: ClientPipes, client: int, msg: ToCore, waiting_calls: list[tuple[int, int, Deferred]]
) -> None:
    """Apply one message from `client`. A refused request is answered to its sender; a control
    call's own deltas (aborts) are sent before its reply, so a caller that sees the reply has seen
    them too. A call that answers later joins `waiting_calls`."""
    if isinstance(msg, AddRequest | AddRequests):
        refusals = []
        for request in msg.requests if isinstance(msg, AddRequests) else [msg]:
            refusal = core.add_request(request)
            if refusal is not None:
                refusals.append(refusal)
            else:
                clients.added(client, request.request_id)
        if refusals:
            clients.send(client, StepOutputs(deltas=refusals))
    elif isinstance(msg, AbortRequests):
        clients.route(core.abort(msg.request_ids))
    elif isinstance(msg, Call):
        if waiting_calls and msg.in_order:  # it runs once the calls before it have
            waiting_calls.append((client, msg.call_id, Deferred(ready=lambda: True, run=lambda: core.call(msg))))
            return
        _run_call(core, clients, client, msg.call_id, lambda: core.call(msg), waiting_calls)


def _run_call(
    core: EngineCore, clients: ClientPipes, client: int, call_id: int, run: Callable[[], Any],
    waiting_calls: list[tuple[int, int, Deferred]],
) -> None:
    """Run a call and answer it, or, when it answers later, put it at the head of `waiting_calls`
    (every call there arrived after it)."""
    try:
        result = run()
    except Exception as e:  # a failed control call is the caller's, not the engine's death
        _reply(core, clients, client, call_id, error=e)
        return
    if isinstance(result, Deferred):
        clients.route(core.take_pending())
        waiting_calls.insert(0, (client, call_id, result))
    else:
        _reply(core, clients, client, call_id, result)


def _answer_ready(core: EngineCore, clients: ClientPipes, waiting_calls: list[tuple[int, int, Deferred]]) -> None:
    """Run, in order of arrival, the waiting calls that are ready now."""
    while waiting_calls and waiting_calls[0][2].ready():
        client, call_id, deferred = waiting_calls.pop(0)
        core.pending += core.drain()  # as every control call: it runs with no step in flight
        _run_call(core, clients, client, call_id, deferred.run, waiting_calls)


_RESULTS = msgspec.msgpack.Encoder()
_NULL = msgspec.Raw(_RESULTS.encode(None))
# A failure of these types is an expected refusal; any other is logged with its traceback.
_REFUSALS = (ValueError, TypeError, LookupError, TimeoutError, PermissionError)


def _reply(
    core: EngineCore, clients: ClientPipes, client: int, call_id: int, result: Any = None, error: Exception | None = None
) -> None:
    """Answer a control call with its result or its failure, and the engine's state after it
    (to the other clients as well)."""
    clients.route(core.take_pending())
    state = core.availability.state()
    if error is None:
        clients.send(client, ControlReply(call_id=call_id, state=state, result=msgspec.Raw(_RESULTS.encode(result))))
    else:
        if not isinstance(error, _REFUSALS):
            log.error("control call %d failed:\n%s", call_id, "".join(traceback.format_exception(error)))
        failure = ControlError(kind=error_kind(error), message=f"{type(error).__name__}: {error}")
        clients.send(client, ControlReply(call_id=call_id, state=state, result=_NULL, error=failure))
    clients.state_to_others(client, state)
    core.after_reply()  # work a call left for after its answer (a weight update's host copy)
