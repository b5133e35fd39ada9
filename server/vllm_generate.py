"""vLLM's tokens-in, tokens-out route, `/inference/v1/generate` (its serve/disagg: GenerateRequest,
GenerateResponse), as SkyRL's and prime-rl's rollouts call it.

Rules:
- In: `token_ids` and `sampling_params` in vLLM's names (max_tokens, min_tokens, temperature,
  top_p, top_k (0 or -1: all), min_p, seed, n, stop, stop_token_ids, ignore_eos, penalties,
  logprobs, prompt_logprobs, logit_bias, skip_special_tokens, ...). max_tokens null or absent
  fills the context, as vLLM's server does. A field vLLM has and this engine cannot honour
  (bad_words, allowed_token_ids, structured outputs, logits processors, truncation, full-vocab
  logprobs) is a 400 when set; an unknown field is a 400 naming it. `model`, when given, must be
  served (404 otherwise). `stream` is not served here (400).
- Out: `choices[i]` with `token_ids`, `finish_reason` ("stop" | "length" | "abort") and, with
  `logprobs` k, `logprobs.content[j]` = {token: "token_id:N", logprob, bytes: null,
  top_logprobs: the sampled token then the top k, k at most (at least one)}; `prompt_logprobs`
  (with `prompt_logprobs` k): None for the first prompt token, then per token {id: {logprob,
  rank, decoded_token}} for the token itself and the top k (rank 1-based among the top k, null
  when the token is not among them); `usage`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.client.output import GenerationOutput
from engine.errors import InvalidRequest
from engine.request import SamplingParams
from server.generation import make_jobs, run_jobs
from server.openai_schemas import MAX_TOP_LOGPROBS
from server.schemas import MAX_N, Int64

router = APIRouter()

# vLLM sampling fields this engine cannot honour: accepted only at their "off" value.
_OFF: dict[str, Any] = {
    "bad_words": (None, []), "allowed_token_ids": (None, []), "logits_processors": (None, []),
    "truncate_prompt_tokens": (None,), "guided_decoding": (None,),
    "best_of": (None, 1),
}


class VllmSampling(BaseModel):
    """vLLM's SamplingParams, as JSON."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=None, ge=0)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_TOP_LOGPROBS)
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: Any = None
    logit_bias: dict[int, float] | None = None
    extra_args: dict[str, Any] | None = None
    skip_clone: bool = False
    bad_words: Any = None
    allowed_token_ids: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    best_of: Any = None

    def to_engine(self, context_left: int) -> SamplingParams:
        for name, off in _OFF.items():
            if getattr(self, name) not in off:
                raise InvalidRequest(f"sampling_params.{name} is not supported")
        if -1 in (self.logprobs, self.prompt_logprobs):
            raise InvalidRequest(f"logprobs -1 (the whole vocabulary) is not supported; at most {MAX_TOP_LOGPROBS}")
        top = max(self.logprobs or 0, self.prompt_logprobs or 0)
        return SamplingParams(
            max_new_tokens=context_left if self.max_tokens is None else self.max_tokens,
            min_new_tokens=self.min_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=-1 if self.top_k == 0 else self.top_k, min_p=self.min_p, seed=self.seed,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, ignore_eos=self.ignore_eos, stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()), logprobs=self.logprobs is not None,
            top_logprobs_num=top, logprob_start_len=0 if self.prompt_logprobs is not None else -1,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.include_stop_str_in_output, logit_bias=tuple((self.logit_bias or {}).items()),
            **self._constraint(),
        )

    def _constraint(self) -> dict[str, str]:
        """vLLM's `structured_outputs` ({json | regex | grammar}, one) as the engine's grammar param."""
        so = self.structured_outputs
        if so is None:
            return {}
        given = {k: v for k, v in so.items() if v is not None} if isinstance(so, dict) else None
        if not given or len(given) != 1 or next(iter(given)) not in ("json", "regex", "grammar"):
            raise InvalidRequest("sampling_params.structured_outputs must give one of json, regex and grammar")
        (kind, spec), = given.items()
        if kind == "json":
            return {"json_schema": spec if isinstance(spec, str) else json.dumps(spec)}
        return {"regex" if kind == "regex" else "ebnf": str(spec)}


class GenerateIn(BaseModel):
    """vLLM's GenerateRequest (SkyRL: remote_inference_client.py::_generate_single sends
    {sampling_params, model, token_ids})."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = None
    token_ids: list[Int64] = Field(min_length=1)
    sampling_params: VllmSampling = Field(default_factory=VllmSampling)
    model: str | None = None
    stream: bool = False
    stream_options: Any = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    features: Any = None


@router.post("/inference/v1/generate")
async def generate(body: GenerateIn, request: Request) -> dict[str, Any]:
    client = request.app.state.client
    request.app.state.model_names.check(body.model)
    if body.stream:
        raise InvalidRequest("stream is not supported on /inference/v1/generate")
    if body.features is not None or body.priority != 0:
        raise InvalidRequest("multimodal features and priority are not supported")
    sp, prompt = body.sampling_params, list(body.token_ids)
    params = sp.to_engine(max(client.info["max_context_length"] - len(prompt), 1))
    rid = body.request_id or uuid.uuid4().hex
    jobs = make_jobs([prompt], params, sp.n, client, [rid])
    outs = await run_jobs(client, request.app.state.metrics, jobs, request)
    tokenizer = client.tokenizer
    choices = [_choice(i, out, sp.logprobs) for i, out in enumerate(outs)]
    completion = sum(len(o.output_ids) for o in outs)
    return {
        "request_id": rid, "id": rid, "object": "generate", "created": int(time.time()),
        "model": request.app.state.model_name, "choices": choices,
        "prompt_logprobs": _prompt_logprobs(outs[0], prompt, sp.prompt_logprobs, tokenizer),
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion},
        "kv_transfer_params": None,
    }


def _choice(index: int, out: GenerationOutput, k: int | None) -> dict[str, Any]:
    logprobs = None
    if k is not None and out.output_token_logprobs is not None:
        tops = out.output_top_logprobs or [[] for _ in out.output_token_logprobs]
        content = []
        for (lp, tok), top in zip(out.output_token_logprobs, tops, strict=True):
            row = [(tok, lp)] + [(t, v) for t, v in top if t != tok]
            content.append({"token": f"token_id:{tok}", "logprob": max(lp, -9999.0), "bytes": None,
                            "top_logprobs": [{"token": f"token_id:{t}", "logprob": max(v, -9999.0), "bytes": None}
                                             for t, v in row[: max(k, 1)]]})
        logprobs = {"content": content}
    return {"index": index, "token_ids": out.output_ids, "finish_reason": out.finish_reason or "stop",
            "logprobs": logprobs}


def _prompt_logprobs(out: GenerationOutput, prompt: list[int], k: int | None, tokenizer: Any) -> list[Any] | None:
    if k is None or out.input_token_logprobs is None:
        return None
    tops = out.input_top_logprobs or [None] * len(prompt)
    rows: list[Any] = [None]
    for (lp, tok), top in zip(out.input_token_logprobs[1:], tops[1:], strict=True):
        ranked = [t for t, _ in (top or [])[:k]]
        entry = {tok: (lp, ranked.index(tok) + 1 if tok in ranked else None)}
        for rank, (t, v) in enumerate((top or [])[:k], 1):
            entry.setdefault(t, (v, rank))
        rows.append({str(t): {"logprob": max(v, -9999.0), "rank": r, "decoded_token": tokenizer.decode([t])}
                     for t, (v, r) in entry.items()})
    return rows
