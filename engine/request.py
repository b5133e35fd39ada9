"""What a user asks for (`SamplingParams`), what the engine tracks per request (`Request`) and what
one step runs (`Batch`). Pure Python: the scheduler and the client import this without torch.
"""

from __future__ import annotations

import enum
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest

# Temperatures below this sample greedily (SGLang's _SAMPLING_EPS): logits / T stays finite.
SAMPLING_EPS = 1e-6
# Every float of a request is used in float32 on the device: it must be finite there too.
FLOAT32_MAX = 3.4028234663852886e38
# SamplingParams' grammar fields (engine/runner/grammar.py KINDS): a request names at most one.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


def _finite32(x: float) -> bool:
    return math.isfinite(x) and abs(x) <= FLOAT32_MAX


@dataclass(frozen=True)
class SamplingParams:
    """Field names as SGLang's `sampling_params`. `top_k` -1 (or 0) means off.

    - `max_new_tokens` 0: prefill only (a teacher scoring a sequence): the request finishes with
      finish_reason length and no output token; its prompt logprobs come back when asked.
    - `no_stop_trim`: the text keeps what ended the request (a stop string, or a stop token's
      text when it is not skipped as special); by default both are cut from the text. Output ids
      always hold the stop token.
    - `spaces_between_special_tokens`: passed to the tokenizer's decode. Python ("slow")
      tokenizers honour it; fast tokenizers (every `tokenizer.json` checkpoint) ignore it.
    - `logit_bias`: (token id, bias) pairs added to the logits after the penalties; a dict is
      accepted too. Token ids (these and `stop_token_ids`) are checked against the vocabulary
      when the request is added.
    - `return_routed_experts` (a top-level field of SGLang's request, as the logprob ones): the
      top-k experts every MoE layer chose for each position but the last (engine/runner/route_log.py);
      the engine must record them (`enable_return_routed_experts`).
    - `temperature` below SAMPLING_EPS (1e-6) is greedy, as in SGLang. Every float must be finite
      in float32, where the sampler uses it.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: also return the logprobs of prompt tokens from this position
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    return_routed_experts: bool = False
    # Grammar-constrained decoding (engine/runner/grammar.py; SGLang's names; at most one): a JSON
    # schema (as JSON text), a regular expression, an EBNF grammar, or a structural tag (JSON text:
    # free text with constrained tags, engine/runner/structural_tag.py).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a bare string for `stop`; store tuples so the object stays hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self._check()

    def _check(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"invalid sampling_params: {msg}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            if not _finite32(getattr(self, name)):
                raise bad(f"{name} must be a finite number (at most {FLOAT32_MAX:.4g} in size), got {getattr(self, name)}")
        if self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise bad(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not 0 <= self.top_logprobs_num <= 20:
            raise bad(f"top_logprobs_num must be in [0, 20], got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise bad(f"logprob_start_len must be -1 (none) or >= 0, got {self.logprob_start_len}")
        if any(not s for s in self.stop):
            raise bad("stop strings must be non-empty")
        if any(not _finite32(b) for _, b in self.logit_bias):
            raise bad(f"logit_bias values must be finite numbers (at most {FLOAT32_MAX:.4g} in size)")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias names a token id twice")
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise bad(f"give at most one of json_schema, regex, ebnf and structural_tag, got {' and '.join(grammars)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """A repetition, frequency or presence penalty: sampling counts the tokens before it."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @functools.cached_property
    def plan_row(self) -> tuple[float, float, float, float, float, float, float, float, int]:
        """This request's entries of every step's `SamplingPlan` that never change, computed once:
        temperature (1.0 when greedy), greedy (0/1), top_k (0 = off), top_p, min_p, the
        repetition, frequency and presence penalties, top_logprobs_num."""
        return (
            self.temperature if self.temperature >= SAMPLING_EPS else 1.0, float(self.greedy), float(max(self.top_k, 0)),
            self.top_p, self.min_p, self.repetition_penalty, self.frequency_penalty, self.presence_penalty,
            self.top_logprobs_num,
        )  # fmt: skip


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# finish_reason values, as SGLang's `meta_info.finish_reason.type` ("error" is ours: a request
# the engine could never run, with `error` saying why).
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"
# Sample i of a request with n > 1 has id f"{rid}{SAMPLE_SEP}{i}"; aborting rid aborts them all.
SAMPLE_SEP = "#"

# Stands in `Request.token_ids` for a token sampled on the device and not yet read back. Never a
# model input: the step that consumes it takes the id from the previous step's device output.
PENDING_TOKEN = -1


@dataclass(eq=False)
class Request:
    """One sequence in the engine. `token_ids` is prompt + output; the KV of its first
    `num_computed_tokens` tokens is in the blocks of `block_table`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_matched: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    # Output tokens sampled by a launched step whose ids the host does not know yet; they end
    # `token_ids` as PENDING_TOKEN (overlap scheduling: at most one, from the step in flight).
    num_pending: int = 0
    # Logprob of prompt token i given tokens < i, filled during prefill when asked for
    # (sampling_params.logprob_start_len >= 0); None where not computed (and for token 0).
    prompt_logprobs: list[float | None] = field(default_factory=list)
    # With top_logprobs_num > 0 as well: the top (token id, logprob) pairs at each such position.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # return_routed_experts: the positions whose routed experts were sent (0 .. routes_sent - 1).
    routes_sent: int = 0
    # The request's grammar matcher (engine/runner/grammar.py `RequestGrammar`) when its params
    # constrain it; the engine process's only.
    grammar: Any = None
    # Speculative decoding (engine/core/drafts.py): tokens proposed to follow `token_ids`, verified
    # by the next step that schedules this request (then cleared); empty when none is proposed.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprob_start_len >= 0:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
            if self.sampling_params.top_logprobs_num > 0:
                self.prompt_top_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @functools.cached_property
    def prompt_key(self) -> int:
        """A hash of the prompt (computed once): requests with equal prompts have equal keys."""
        return hash(tuple(self.prompt_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may hold at most: its prompt plus every token it may generate."""
        return self.num_prompt_tokens + self.sampling_params.max_new_tokens

    @property
    def prefix_cache_limit(self) -> int:
        """Tokens the prefix cache may serve: past them the engine needs the logits itself."""
        start = self.sampling_params.logprob_start_len
        return self.num_tokens if start < 0 else max(start - 1, 0)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the pending ones at the end."""
        return len(self.token_ids) - self.num_pending

    @property
    def awaiting_last_token(self) -> bool:
        """Its last token is sampled but not yet known here: nothing is left to compute for it."""
        return self.num_pending > 0 and self.num_output_tokens >= self.sampling_params.max_new_tokens

    def add_pending_token(self) -> None:
        """A step that samples this request was launched: its token joins `token_ids` as
        `PENDING_TOKEN` until `resolve_token` gives the id (a prefill-only request keeps none)."""
        if self.sampling_params.max_new_tokens > 0:
            self.token_ids.append(PENDING_TOKEN)
            self.num_pending += 1

    def resolve_token(self, token_id: int) -> None:
        """The oldest pending token is `token_id`: set it, and finish the request if it hit a stop
        condition, dropping the pending tokens after it (a later step sampled them in vain).
        String stops are the client's job: it sees text, and aborts the request on a match.
        A prefill-only request (max_new_tokens 0) keeps no token and finishes with length."""
        sp = self.sampling_params
        if sp.max_new_tokens == 0:
            self.finish(FINISH_LENGTH)
            return
        if self.num_pending < 1:
            raise RuntimeError(f"request {self.request_id} has no pending token to resolve")
        index = len(self.token_ids) - self.num_pending
        self.token_ids[index] = token_id
        self.num_pending -= 1
        n_out = index + 1 - self.num_prompt_tokens
        if n_out >= sp.min_new_tokens and (
            token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in self.eos_token_ids)
        ):
            self.finish(FINISH_STOP, matched=token_id)
        elif n_out >= sp.max_new_tokens:
            self.finish(FINISH_LENGTH)
        elif self.grammar is not None and self.grammar.ended:  # its grammar allows nothing more
            self.finish(FINISH_STOP)
        if self.finished:
            del self.token_ids[index + 1 :]
            self.num_pending = 0

    def finish(self, reason: str, matched: int | str | None = None, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_matched = matched
        self.error = error


@dataclass
class Batch:
    """One engine step. Request i runs tokens `token_ids[num_computed_tokens : num_computed_tokens +
    num_new_tokens[i]]`; it samples a next token iff that chunk reaches the end of its tokens.
    A request with drafts (`drafts[i]`, speculative decoding) runs its last token and then its
    drafts: num_new_tokens[i] is 1 + len(drafts[i]), and it samples at each of those positions."""

    requests: list[Request]
    num_new_tokens: list[int]
    drafts: dict[int, list[int]] = field(default_factory=dict)  # batch index -> its draft tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def samples(self, i: int) -> bool:
        r = self.requests[i]
        return r.num_computed_tokens + self.num_new_tokens[i] - len(self.drafts.get(i, ())) == r.num_tokens

    def __len__(self) -> int:
        return len(self.requests)
