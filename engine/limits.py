"""What a request may be: `RequestLimits` (the engine's sizes) and `prompt_error`, the one list of
rules a prompt is checked against.

Where it is checked (each where it is cheapest, all with this one function):
- the server, before the request is sent: a 400 with no engine round trip (limits from the
  engine's `Ready` info: `RequestLimits.from_info`);
- `EngineCore.add_request`, for every caller (`engine.Engine` included): the request is finished
  at once with the error, before the scheduler sees it.
The scheduler relies on it: a request it holds fits the KV cache alone, so the oldest running
request can always preempt the others and progress.
Pure Python; every process imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.request import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # prompt + max_new_tokens, at most
    kv_blocks: int  # the whole KV cache, in blocks of block_size tokens
    block_size: int
    eos_token_ids: tuple[int, ...] = ()  # the model's: they end a request unless ignore_eos

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> RequestLimits:
        """The limits in `EngineCore.get_info()`'s answer."""
        return cls(
            info["vocab_size"], info["max_context_length"], info["kv_blocks_total"], info["block_size"],
            tuple(info["eos_token_ids"]),
        )


def prompt_error(prompt_token_ids: Sequence[int], params: SamplingParams, limits: RequestLimits) -> str | None:
    """Why a request can never run, or None. It is judged at its largest size: the prompt plus
    `max_new_tokens`."""
    n = len(prompt_token_ids)
    if n == 0:
        return "the prompt is empty"
    error = vocab_error(prompt_token_ids, limits.vocab_size)
    if error is None and params.logit_bias:
        error = vocab_error([t for t, _ in params.logit_bias], limits.vocab_size, "logit_bias token id")
    if error is None and params.stop_token_ids:
        error = vocab_error(params.stop_token_ids, limits.vocab_size, "stop_token_ids token id")
    if error is None and params.top_logprobs_num > limits.vocab_size:
        error = f"top_logprobs_num {params.top_logprobs_num} exceeds the vocabulary's {limits.vocab_size} tokens"
    if error is None and params.min_new_tokens > 0:
        # min_new_tokens bans every token that would end the request; one must remain.
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(limits.eos_token_ids))
        if sum(0 <= t < limits.vocab_size for t in ends) == limits.vocab_size:
            error = f"min_new_tokens {params.min_new_tokens} can never be met: every token of the vocabulary ends the request"
    if error is not None:
        return error
    total = n + params.max_new_tokens
    asked = f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens})"
    if total > limits.max_model_len:
        return f"{asked} exceeds the context length of {limits.max_model_len} tokens"
    blocks = -(-total // limits.block_size)
    if blocks > limits.kv_blocks:
        return (
            f"{asked} needs {blocks} KV blocks of {limits.block_size} tokens, but the KV cache holds only "
            f"{limits.kv_blocks} ({limits.kv_blocks * limits.block_size} tokens)"
        )
    return None


def vocab_error(ids: Sequence[int], vocab: int, what: str = "token id") -> str | None:
    """The first id outside [0, vocab), named, or None."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    return None if bad is None else f"{what} {bad} is outside the vocabulary [0, {vocab})"
