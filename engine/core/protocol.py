"""Messages between the clients (`Engine`, the HTTP server) and the `EngineCore` process.

Two ZeroMQ IPC sockets per client carry them, msgspec-encoded: client -> core (PUSH/PULL) for
requests and control calls (one struct per call: engine/core/calls.py), core -> client (PUSH/PULL)
for token deltas and replies (the engine's end of several clients: engine/core/client_pipes.py). Each message is a tagged struct so one decoder reads a union.
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from engine.core.availability import EngineState
from engine.core.calls import ControlCall
from engine.request import SamplingParams


def connect_pipes(
    in_addr: str, out_addr: str, ctx: zmq.Context | None = None
) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """A child process's end of two sockets (the engine process, for each client; a
    tensor-parallel worker): (context, given or new, inbox PULL from in_addr, outbox PUSH to
    out_addr, lingering 2 s at close so a last Failed reply still goes out)."""
    ctx = ctx or zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(out_addr)
    return ctx, inbox, outbox


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


class AddRequests(msgspec.Struct, tag=True):
    """Several requests sent together (one `generate` call's prompts, one HTTP request's jobs):
    the engine adds them all before its next step, so its scheduler sees the whole batch at once
    (budget, `max_num_seqs` and samples waiting for their prompt's prefill apply as ever) and
    schedules it the same way on every run, however fast the sender was."""

    requests: list[AddRequest]


class AbortRequests(msgspec.Struct, tag=True):
    """Abort the named requests; `None` aborts every request in the engine."""

    request_ids: list[str] | None


class Shutdown(msgspec.Struct, tag=True):
    pass


class RequestDelta(msgspec.Struct, array_like=True):
    """What one step produced for one request. Token lists hold 0 tokens (a request finished with
    no new token, e.g. aborted) or 1 per step; a client concatenates them. Encoded as an array
    (no field names): a step carries one per running request, and the server decodes them all."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With the first output token, when asked: logprobs of prompt tokens logprob_start_len.. (None
    # for token 0, which nothing predicts).
    input_logprobs: list[float | None] | None = None
    # With those and top_logprobs_num > 0: the top (token id, logprob) pairs at each (None for token 0).
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_matched: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    unavailable: bool = False  # refused because the engine cannot serve now (memory released): 503
    # return_routed_experts: the routed experts of the positions this step made known, int32
    # [positions, num_layers, top_k] as bytes (engine/runner/route_log.py); a client concatenates them.
    routed_experts: bytes | None = None


class StepOutputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]


class ControlError(msgspec.Struct):
    """A control call that failed: `kind` names its exception type (engine/errors.py)."""

    kind: str
    message: str


class ControlReply(msgspec.Struct, tag=True):
    """The answer to one control call (engine/core/calls.py). `result` is the call's `reply`
    type, encoded: the client decodes it knowing the call. Every reply carries the engine's state."""

    call_id: int
    state: EngineState
    result: msgspec.Raw  # the encoded result; null when the call failed
    error: ControlError | None = None


class Ready(msgspec.Struct, tag=True):
    """Sent once when the core has built everything; `info` is `EngineCore.get_info()`."""

    info: dict[str, Any]
    state: EngineState


class StateUpdate(msgspec.Struct, tag=True):
    """The engine's state after a control call that another client made (several API server
    processes: engine/core/client_pipes.py)."""

    state: EngineState


class Failed(msgspec.Struct, tag=True):
    """Sent when the core cannot start or dies; the client raises `EngineDeadError` with it."""

    error: str


ToCore = AddRequest | AddRequests | AbortRequests | Shutdown | ControlCall
FromCore = StepOutputs | ControlReply | StateUpdate | Ready | Failed
