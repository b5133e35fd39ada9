"""Client-side assembly of one request's output from the core's token deltas: detokenization,
stop strings and logprobs. Shared by the blocking `Engine` and the server's async client, whose
requests in flight (`LiveRequest`) and their consumers (`Consumer`, `Waker`) are here too.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.client.detokenizer import IncrementalDetokenizer
from engine.core.protocol import RequestDelta
from engine.errors import EngineUnavailable, InvalidRequest
from engine.request import FINISH_ABORT, FINISH_ERROR, FINISH_STOP, SamplingParams


@dataclass
class GenerationOutput:
    """A request's result, or its state so far while it runs (`text` grows with the tokens, as
    SGLang streams it). `finish_reason` is "stop" | "length" | "abort"; a request the engine
    refused is an "abort" with `error` saying why (as SGLang reports it); an aborted one has
    `abort_message` saying what aborted it (SGLang's finish_reason.message)."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    error: str | None = None
    abort_message: str | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None  # from logprob_start_len
    # With top_logprobs_num > 0 too: each of those positions' top (token id, logprob) pairs.
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    # return_routed_experts: [prompt + output - 1, num_layers, top_k] as bytes (SGLang's layout) of
    # `routed_experts_dtype` integers (the engine's --routed-experts-dtype, int32 unless set), and
    # their base64 as it arrives (the server's answer: no encoding left for the end).
    routed_experts: bytearray | None = None
    routed_experts_base64: Base64Stream | None = None
    routed_experts_dtype: str = "int32"
    cached_tokens: int = 0
    e2e_latency: float = 0.0
    unavailable: bool = False  # refused because the engine cannot serve now (memory released)
    refused: bool = False  # refused by the engine at arrival, `error` says why (e.g. its id runs already)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def refusal(self) -> Exception | None:
        """What a route raises for a request the engine refused at arrival: `EngineUnavailable`
        (503) while it cannot serve, `InvalidRequest` (400) otherwise; None for any other output."""
        if self.unavailable:
            return EngineUnavailable(self.error or "the engine cannot serve now")
        if self.refused:
            return InvalidRequest(self.error or "the engine refused the request")
        return None


class Base64Stream:
    """The base64 of bytes that arrive in pieces, encoded as they arrive: whole 3-byte groups at
    once, the rest carried into the next piece. The base64 of a concatenation is the concatenation
    of its pieces' base64 when every piece but the last is a multiple of 3 bytes long."""

    __slots__ = ("_parts", "_rest")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._rest = b""

    def add(self, data: bytes) -> None:
        buf = self._rest + data if self._rest else data
        cut = len(buf) - len(buf) % 3
        if cut:
            self._parts.append(base64.b64encode(memoryview(buf)[:cut]))
        self._rest = bytes(buf[cut:])

    def pieces(self) -> list[bytes]:
        """The base64 text (ASCII) of every byte added so far, in the pieces it was made in."""
        return [*self._parts, base64.b64encode(self._rest)]

    def value(self) -> bytes:
        """The base64 text (ASCII) of every byte added so far."""
        return b"".join(self.pieces())


@dataclass(slots=True)
class StepUpdate:
    """What one delta changed: new text safe to show, new token ids, and whether the request is
    finished. `abort` is set when a stop string matched and the core must be told to stop it."""

    text: str
    token_ids: list[int]
    finished: bool
    abort: bool = False


class RequestState:
    """One request's output as its deltas arrive. `incremental` False (a whole response with no
    stop strings: nothing needs the text before the end) keeps the ids to show and decodes them
    once, at the end, through the same detokenizer: the text is the same, the work one decode."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Any,
        incremental: bool = True, routes_dtype: str = "int32",
    ) -> None:
        if not incremental and params.stop:
            raise ValueError("stop strings are matched as text arrives: they need incremental decoding")
        self.params = params
        self.incremental = incremental
        self._unshown: list[int] = []  # ids not decoded yet (incremental False)
        self.started = time.monotonic()
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
            no_stop_trim=params.no_stop_trim, spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self.output = GenerationOutput(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            output_token_logprobs=[] if params.logprobs else None,
            output_top_logprobs=[] if params.top_logprobs_num > 0 else None,
            routed_experts=bytearray() if params.return_routed_experts else None,
            routed_experts_base64=Base64Stream() if params.return_routed_experts else None,
            routed_experts_dtype=routes_dtype,
        )

    def apply(self, delta: RequestDelta) -> StepUpdate:
        out = self.output
        if out.finish_reason is not None:  # e.g. the core's abort confirmation after a stop-string match
            return StepUpdate("", [], True)
        out.cached_tokens = delta.num_cached_tokens
        new_ids = delta.new_token_ids
        out.output_ids += new_ids
        if delta.new_logprobs is not None and out.output_token_logprobs is not None:
            out.output_token_logprobs += list(zip(delta.new_logprobs, new_ids, strict=True))
        if delta.new_top_logprobs is not None and out.output_top_logprobs is not None:
            out.output_top_logprobs += [[(int(t), float(lp)) for t, lp in row] for row in delta.new_top_logprobs]
        if delta.routed_experts is not None and out.routed_experts is not None:
            out.routed_experts += delta.routed_experts
            out.routed_experts_base64.add(delta.routed_experts)
        if delta.input_logprobs is not None:
            start = self.params.logprob_start_len
            out.input_token_logprobs = list(zip(delta.input_logprobs, out.prompt_token_ids[start:], strict=True))
        if delta.input_top_logprobs is not None:
            out.input_top_logprobs = [None if row is None else [(int(t), float(lp)) for t, lp in row]
                                      for row in delta.input_top_logprobs]
        finished = delta.finished
        if not finished and self.incremental and delta.finish_reason is None:  # the common case: a running request
            detok = self.detok
            text = self._step_text(new_ids) if new_ids else ""
            out.text = detok.text
            if detok.stop_matched is not None:
                self._finish(FINISH_STOP, detok.stop_matched, None)
                return StepUpdate(text, new_ids, True, True)
            return StepUpdate(text, new_ids, False)
        shown = new_ids
        if delta.finish_reason == FINISH_STOP and isinstance(delta.stop_matched, int) and not self.params.no_stop_trim:
            shown = new_ids[:-1]  # the stop token's text is cut (SGLang's trim), its id stays
        if not self.incremental:
            self._unshown += shown
            shown = self._unshown if finished else []
        text = self._step_text(shown, trim=shown is new_ids) if shown else ""
        out.text = self.detok.text
        if self.detok.finished_by_stop:
            self._finish(FINISH_STOP, self.detok.stop_matched, None)
            return StepUpdate(text=text, token_ids=new_ids, finished=True, abort=not finished)
        if finished:
            text += self.detok.flush()
            reason = FINISH_ABORT if delta.finish_reason == FINISH_ERROR else delta.finish_reason
            aborted = delta.finish_reason == FINISH_ABORT  # delta.error says what aborted it
            self._finish(reason, delta.stop_matched, None if aborted else delta.error)
            self.output.abort_message = delta.error if aborted else None
            out.unavailable = delta.unavailable
            out.refused = delta.finish_reason == FINISH_ERROR and not delta.unavailable
        return StepUpdate(text=text, token_ids=new_ids, finished=finished)

    def _step_text(self, ids: list[int], trim: bool = True) -> str:
        """The detokenizer's text of `ids`, the tokens of this delta (with `trim`: the tail of
        `output.output_ids`). Several at once (accepted drafts) with stop strings: a token at a
        time, and the tokens after the one that completed a stop string are dropped, as plain
        decoding, which stops there, never makes them."""
        detok = self.detok
        if len(ids) < 2 or not detok.stop or not trim:
            return detok.step(ids)
        text = ""
        for j, token in enumerate(ids):
            text += detok.step([token])
            if detok.stop_matched is not None:
                extra = len(ids) - j - 1
                out = self.output
                for tail in (out.output_ids, out.output_token_logprobs, out.output_top_logprobs):
                    if tail is not None and extra:
                        del tail[-extra:]
                break
        return text

    def _finish(self, reason: str | None, matched: int | str | None, error: str | None) -> None:
        out = self.output
        out.text = self.detok.text
        out.finish_reason = reason
        out.matched_stop = matched
        out.error = error
        out.e2e_latency = time.monotonic() - self.started


class Consumer(Protocol):
    """What a request's updates notify: `set` is called on each change (in the reader)."""

    def set(self) -> None: ...


class Waker:
    """Wakes the one task waiting on it. A `set` while nobody waits makes the next `wait` return at
    once (no wake is lost); several sets before the waiter runs wake it once. Cheaper than
    `asyncio.Event`, which the reader would set for every request on every step."""

    __slots__ = ("_future", "_flag")

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None
        self._flag = False

    def set(self) -> None:
        self._flag = True
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self) -> None:
        if not self._flag:
            future = self._future = asyncio.get_running_loop().create_future()
            try:
                await future
            finally:
                self._future = None
        self._flag = False


@dataclass(eq=False, slots=True)
class LiveRequest:
    """A request in flight as the reader sees it: its state, whether its consumer has something to
    take (`ready`), and the waker of that consumer. `take` returns what changed since the last
    take: the output only grows (text and ids), so that is a slice of it."""

    state: RequestState
    every_step: bool  # wake per step (streams); else only at the end
    waker: Consumer
    on_tokens: Callable[[int], None] | None = None  # told each step's new token count (metrics)
    ready: bool = False
    error: Exception | None = None  # the engine died: EngineDeadError
    _ids_taken: int = 0
    _chars_taken: int = 0

    @property
    def request_id(self) -> str:
        return self.state.output.request_id

    def take(self) -> StepUpdate:
        """Every change since the last take, as one update."""
        self.ready = False
        out = self.state.output
        ids = out.output_ids[self._ids_taken :]
        text = out.text[self._chars_taken :]
        self._ids_taken += len(ids)
        self._chars_taken = len(out.text)
        return StepUpdate(text=text, token_ids=ids, finished=out.finish_reason is not None)
