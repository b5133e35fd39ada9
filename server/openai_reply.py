"""`Reply`: the shapes of one OpenAI-compatible response, whole or in stream chunks: choices,
usage, and logprobs in the legacy completions format and the chat format.

Rules:
- finish_reason is "stop" (EOS, a stop token or a stop string), "length", or "abort" (aborted by
  /abort_request or a pause). A request the engine refused outright raises `InvalidRequest`
  (a 400, or an error event when streaming) instead of becoming a choice.
- `stop_reason` (vLLM's extension) is the stop string or token id that ended a choice, EOS
  included, else null.
- usage counts each prompt once, however many samples it has, and every generated token.
- Logprob token strings are each token decoded alone, special tokens included; a logprob of
  -inf (or, should one ever come, NaN) is sent as -9999.0 (JSON has neither).
- When streaming, each chunk carries the logprobs of the tokens that arrived since the last one.
- `return_token_ids` (vLLM's): each choice (each chunk of a stream) carries `token_ids`, the ids
  of its text; a completion's choice its `prompt_token_ids` once, a chat response (its first
  chunk when streamed) the prompt's at the top level.
- Completions with `echo` and `logprobs`: each choice's logprobs start with its prompt's tokens
  (the first with null logprob and alternatives, nothing predicting it), offsets from 0; the
  generated tokens' offsets start at the echoed prompt text's length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.client.output import GenerationOutput
from engine.errors import InvalidRequest
from server.generation import Job
from server.token_text import TokenText
from server.tool_calls import Call, HermesStream, ToolChoice

_MIN_LOGPROB = -9999.0

Choice = dict[str, Any]


def _lp(value: float) -> float:
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB  # NaN compares false


@dataclass
class Reply:
    """One response: what all its chunks share, and per choice what was streamed so far.
    `jobs` are prompt-major, `n` per prompt; choice i is job i."""

    id: str
    object: str  # "text_completion" | "chat.completion" | "chat.completion.chunk"
    model: str
    tokenizer: Any
    jobs: list[Job]
    n: int
    logprobs: bool  # logprobs were asked for
    include_usage: bool = False  # streaming: end with a usage chunk
    prompt_logprobs: bool = False  # completions' echo with logprobs: the prompt's tokens lead each choice's
    tools: ToolChoice | None = None  # chat with tools: outputs parsed into calls (server/tool_calls.py)
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: TokenText = field(init=False)
    _lp_sent: dict[int, int] = field(default_factory=dict)  # choice -> tokens whose logprobs went
    _prompt_lp_sent: set[int] = field(default_factory=set)  # choices whose prompt logprobs went
    _offset: dict[int, int] = field(default_factory=dict)  # choice -> text_offset of its next token
    _choice_of: dict[str, int] = field(init=False)
    _tool_streams: dict[int, HermesStream] = field(default_factory=dict)  # auto: a streamed choice's parser
    _tool_texts: dict[int, str] = field(default_factory=dict)  # forced: a streamed choice's text so far
    _calls_sent: dict[int, int] = field(default_factory=dict)  # choice -> tool calls streamed
    _ids_sent: dict[int, int] = field(default_factory=dict)  # return_token_ids: choice -> token ids sent

    def __post_init__(self) -> None:
        self._token_text = TokenText(self.tokenizer)
        self._choice_of = {j.request_id: j.index for j in self.jobs}  # engine id -> choice index

    @property
    def chat(self) -> bool:
        return self.object.startswith("chat.")

    # ---- whole responses and chunks -------------------------------------------------------------

    def body(self, choices: list[Choice], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def chunk(self, choices: list[Choice]) -> dict[str, Any]:
        """A stream chunk; with include_usage every chunk but the last has `usage: null`."""
        return self.body(choices, **({"usage": None} if self.include_usage else {}))

    def usage(self, outs: dict[int, GenerationOutput]) -> dict[str, int]:
        return self._usage(sum(len(o.output_ids) for o in outs.values()))

    def _usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(j.prompt_token_ids) for j in self.jobs[:: self.n])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole_choice(self, out: GenerationOutput, prefix: dict[int, str] | None = None) -> tuple[Choice, int]:
        """A finished job's choice in the non-streaming response, built as soon as it ends
        (`run_jobs`' finish), and its token count; `prefix` is the echoed prompt text per choice."""
        i = self._choice_of[out.request_id]
        text = (prefix or {}).get(i, "")
        self._offset[i] = len(text)
        return self.choice(i, text + out.text, out, finished=True), len(out.output_ids)

    def full(self, choices: list[tuple[Choice, int]]) -> dict[str, Any]:
        """The non-streaming response from every job's `whole_choice`, in the jobs' order."""
        extra = {"prompt_token_ids": self.jobs[0].prompt_token_ids} if self.chat and self.return_token_ids else {}
        return self.body([c for c, _ in choices], usage=self._usage(sum(n for _, n in choices)), **extra)

    def choice(self, index: int, text: str, out: GenerationOutput | None, finished: bool) -> Choice:
        """A choice (whole) or a delta of one (streaming): `text` is all of it, or what is new."""
        c: Choice = {"index": index}
        calls: list[Call] = []
        if self.object == "chat.completion":
            content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
            c["message"] = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        elif self.chat:
            content, calls = self._streamed_tools(index, text, finished) if self.tools is not None else (text, [])
            c["delta"] = {"content": content} if content else {}
            if calls:
                first = self._calls_sent.get(index, 0)
                c["delta"]["tool_calls"] = [{"index": first + k} | call for k, call in enumerate(calls)]
                self._calls_sent[index] = first + len(calls)
        else:
            c["text"] = text
        c["logprobs"] = self._logprobs(index, out) if self.logprobs and out is not None else None
        if self.return_token_ids and out is not None:
            start = self._ids_sent.get(index, 0)
            if start == 0 and not self.chat:  # a completion's choice: its prompt, first time only
                c["prompt_token_ids"] = self.jobs[index].prompt_token_ids
            c["token_ids"] = out.output_ids[start:]
            self._ids_sent[index] = len(out.output_ids)
        c["finish_reason"] = None
        if finished and out is not None:
            if out.error is not None:
                raise InvalidRequest(f"the engine refused the request: {out.error}")
            reason = out.finish_reason
            if self.tools is not None:
                made = calls if self.object == "chat.completion" else [None] * self._calls_sent.get(index, 0)
                reason = self.tools.finish_reason(reason, made)
            c |= {"finish_reason": reason, "stop_reason": out.matched_stop}
        return c

    def _streamed_tools(self, index: int, text: str, finished: bool) -> tuple[str | None, list[Call]]:
        """A streamed choice's new (content, calls): `auto` parses as text arrives; a forced
        choice is one JSON text, parsed when it ends."""
        tools = self.tools
        assert tools is not None
        if tools.mode == "none":
            return text, []
        if tools.mode == "auto":
            content, calls = self._tool_streams.setdefault(index, tools.stream()).feed(text, final=finished)
            if not tools.parallel:
                calls = calls[: max(0, 1 - self._calls_sent.get(index, 0))]
            return content, calls
        self._tool_texts[index] = self._tool_texts.get(index, "") + text
        return tools.parse(self._tool_texts.pop(index)) if finished else (None, [])

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of each choice."""
        delta = {"role": "assistant", "content": ""}
        chunk = self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
        if self.return_token_ids:
            chunk["prompt_token_ids"] = self.jobs[index].prompt_token_ids
        return chunk

    def echo_chunk(
        self, index: int, prompt_text: str, text: str = "", out: GenerationOutput | None = None, finished: bool = False
    ) -> dict[str, Any]:
        """A completions stream's first chunk of each choice when echo is on: the prompt's text,
        and with `out` (echo with logprobs) the text of its first update and the logprobs so far."""
        self._offset[index] = len(prompt_text)
        return self.chunk([self.choice(index, prompt_text + text, out, finished)])

    # ---- logprobs -------------------------------------------------------------------------------

    def _logprobs(self, index: int, out: GenerationOutput) -> dict[str, Any]:
        new = self._new_logprobs(index, out)
        return self._chat_logprobs(new) if self.chat else self._completion_logprobs(index, new, out)

    def _new_logprobs(self, index: int, out: GenerationOutput) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """(logprob, token, top alternatives) of the tokens of choice `index` not sent yet."""
        start = self._lp_sent.get(index, 0)
        pairs = out.output_token_logprobs or []
        tops = out.output_top_logprobs
        self._lp_sent[index] = len(pairs)
        return [(lp, tok, tops[k] if tops is not None else []) for k, (lp, tok) in enumerate(pairs) if k >= start]

    def _prompt_entries(self, index: int, out: GenerationOutput) -> dict[str, list[Any]]:
        """The legacy logprobs of choice `index`'s prompt tokens, once (echo with logprobs): the
        first token has none (nothing predicts it); each entry's top alternatives hold the top N
        and the prompt's token; offsets lay the token texts end to end from 0."""
        lps: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if not self.prompt_logprobs or index in self._prompt_lp_sent or out.input_token_logprobs is None:
            return lps
        self._prompt_lp_sent.add(index)
        tops = out.input_top_logprobs or [None] * len(out.input_token_logprobs)
        offset = 0
        for (lp, tok), top in zip(out.input_token_logprobs, tops, strict=True):
            text = self._token_text(tok)
            lps["tokens"].append(text)
            lps["token_logprobs"].append(None if lp is None else _lp(lp))
            lps["top_logprobs"].append(None if lp is None else self._alternatives(top or [], text, lp))
            lps["text_offset"].append(offset)
            offset += len(text)
        return lps

    def _alternatives(self, top: list[tuple[int, float]], text: str, lp: float) -> dict[str, float]:
        """A token's top alternatives by text, best first, with the token itself."""
        alternatives: dict[str, float] = {}
        for t, v in top:
            alternatives.setdefault(self._token_text(t), _lp(v))
        alternatives.setdefault(text, _lp(lp))
        return alternatives

    def _completion_logprobs(self, index: int, new: list[tuple[float, int, list[tuple[int, float]]]], out: GenerationOutput) -> dict[str, Any]:
        """OpenAI's legacy format. Each top_logprobs entry holds the top N and the sampled token
        (so N + 1 entries at most); text_offset is where each token starts in the choice's text,
        token texts laid end to end after the echoed prompt, if any (whose own tokens lead, with
        echo)."""
        lps = self._prompt_entries(index, out)
        for lp, tok, top in new:
            text = self._token_text(tok)
            offset = self._offset.get(index, 0)
            lps["tokens"].append(text)
            lps["token_logprobs"].append(_lp(lp))
            lps["top_logprobs"].append(self._alternatives(top, text, lp))
            lps["text_offset"].append(offset)
            self._offset[index] = offset + len(text)
        return lps

    def _chat_logprobs(self, new: list[tuple[float, int, list[tuple[int, float]]]]) -> dict[str, Any]:
        """OpenAI's chat format: per token its text, logprob, UTF-8 bytes, and the top N."""

        def entry(tok: int, lp: float) -> dict[str, Any]:
            text = self._token_text(tok)
            return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(tok, lp) | {"top_logprobs": [entry(t, v) for t, v in top]} for lp, tok, top in new]}
