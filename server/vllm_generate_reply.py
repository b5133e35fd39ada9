"""What `/inference/v1/generate` answers, whole or streamed, in vLLM's shapes (its
serve/disagg/protocol.py GenerateResponse, GenerateStreamResponse; serving.py ServingTokens).

Rules:
- A choice: `index`, `token_ids`, `finish_reason` ("stop" | "length" | "abort"), `logprobs`
  (with `logprobs` k: `content[j]` = {token: "token_id:N", logprob, bytes: null, top_logprobs:
  the sampled token then the top k, k at most (at least one)}, as vLLM's _create_tokens_logprobs
  lists them; logprobs clamped at -9999).
- `prompt_logprobs` (whole answers only, with `prompt_logprobs` k): None for the first prompt
  token, then per token {id: {logprob, rank, decoded_token}} for the token itself and the top k
  (rank 1-based among the top k, null when the token is not among them).
- A stream (`serve_tokens_stream_generator`): `data: {request_id, choices: [one choice], usage}`
  per job update with new token ids, the choice holding only the new ids and their logprobs, its
  finish_reason null until the job's last chunk; with `stream_options.include_usage` a last chunk
  {request_id, choices: [], usage} for the whole request (and `continuous_usage_stats`: each
  chunk's usage counts its job's tokens so far); then `data: [DONE]`. vLLM skips a job's end
  that brings no token (an abort between steps): here that end is a chunk with `token_ids: []`,
  so the client always reads how each job ended. No prompt logprobs are streamed (vLLM sends
  none there either). An engine failure after the status line is an in-band `{"error": ...}`
  event before [DONE] (server/event_stream.py).
"""

from __future__ import annotations

from typing import Any

from engine.client.output import GenerationOutput
from server.event_stream import Batch, event

FLOOR = -9999.0  # vLLM's clamp of a logprob (-inf included) in its answers


def logprobs_content(out: GenerationOutput, start: int, end: int, k: int) -> dict[str, Any]:
    """vLLM's ChatCompletionLogProbs for output tokens [start, end) of `out`."""
    pairs = (out.output_token_logprobs or [])[start:end]
    tops = (out.output_top_logprobs or [])[start:end] or [[] for _ in pairs]
    content = []
    for (lp, tok), top in zip(pairs, tops, strict=True):
        row = [(tok, lp)] + [(t, v) for t, v in top if t != tok]
        content.append({"token": f"token_id:{tok}", "logprob": max(lp, FLOOR), "bytes": None,
                        "top_logprobs": [{"token": f"token_id:{t}", "logprob": max(v, FLOOR), "bytes": None}
                                         for t, v in row[: max(k, 1)]]})
    return {"content": content}


def whole_choice(index: int, out: GenerationOutput, k: int | None) -> dict[str, Any]:
    logprobs = None
    if k is not None and out.output_token_logprobs is not None:
        logprobs = logprobs_content(out, 0, len(out.output_ids), k)
    return {"index": index, "token_ids": out.output_ids, "finish_reason": out.finish_reason or "stop",
            "logprobs": logprobs}


def prompt_logprobs(out: GenerationOutput, prompt: list[int], k: int | None, tokenizer: Any) -> list[Any] | None:
    if k is None or out.input_token_logprobs is None:
        return None
    tops = out.input_top_logprobs or [None] * len(prompt)
    rows: list[Any] = [None]
    for (lp, tok), top in zip(out.input_token_logprobs[1:], tops[1:], strict=True):
        ranked = [t for t, _ in (top or [])[:k]]
        entry = {tok: (lp, ranked.index(tok) + 1 if tok in ranked else None)}
        for rank, (t, v) in enumerate((top or [])[:k], 1):
            entry.setdefault(t, (v, rank))
        rows.append({str(t): {"logprob": max(v, FLOOR), "rank": r, "decoded_token": tokenizer.decode([t])}
                     for t, (v, r) in entry.items()})
    return rows


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenChunks:
    """The stream's events (server/event_stream.py `Events`) for one request's jobs."""

    def __init__(self, request_id: str, prompt_tokens: int, k: int | None, include_usage: bool, continuous: bool) -> None:
        self.request_id, self.prompt_tokens, self.k = request_id, prompt_tokens, k
        self.include_usage, self.continuous = include_usage, continuous

    def first(self) -> bytes:
        return b""

    def render(self, batch: Batch) -> bytes:
        events = []
        for job, update, out in batch:
            new = update.token_ids
            if not new and not update.finished:
                continue
            end = len(out.output_ids)
            start = end - len(new)
            logprobs = None
            if self.k is not None and out.output_token_logprobs is not None:
                logprobs = logprobs_content(out, start, end, self.k)
            choice = {"index": job.index, "logprobs": logprobs,
                      "finish_reason": (out.finish_reason or "stop") if update.finished else None,
                      "token_ids": new, "routed_experts": None}
            counted = usage(self.prompt_tokens, end) | {"prompt_tokens_details": None} if self.continuous else None
            events.append(event({"request_id": self.request_id, "choices": [choice], "usage": counted}))
        return b"".join(events)

    def end(self, outs: dict[int, GenerationOutput]) -> bytes:
        if not self.include_usage:
            return b""
        completion = sum(len(o.output_ids) for o in outs.values())
        return event({"request_id": self.request_id, "choices": [], "usage": usage(self.prompt_tokens, completion)})
