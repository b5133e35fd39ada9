"""vLLM's tokens-in, tokens-out route, `/inference/v1/generate` (its serve/disagg: GenerateRequest,
GenerateResponse, GenerateStreamResponse), as SkyRL's and prime-rl's rollouts call it.

Rules:
- In: `token_ids` and `sampling_params` in vLLM's names (max_tokens, min_tokens, temperature,
  top_p, top_k (0 or -1: all), min_p, seed, n, stop, stop_token_ids, ignore_eos, penalties,
  logprobs, prompt_logprobs, logit_bias, skip_special_tokens, structured_outputs ({json | regex |
  grammar | structural_tag}, one), ...). max_tokens null or absent fills the context, as vLLM's
  server does. A field vLLM has and this engine cannot honour (bad_words, allowed_token_ids,
  logits processors, truncation, full-vocab logprobs) is a 400 when set; an unknown field is a
  400 naming it. `model`, when given, must be served (404 otherwise).
- `stream: true` answers server-sent events as vLLM streams them; `stream_options`
  {include_usage (true when the object is given), continuous_usage_stats} as vLLM reads them.
  A client that goes away mid-stream aborts its jobs in the engine.
- Out: server/vllm_generate_reply.py (choices, logprobs, prompt logprobs, stream chunks).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequest
from engine.request import SamplingParams
from server.event_stream import EventStream
from server.generation import make_jobs, run_jobs
from server.openai_schemas import MAX_TOP_LOGPROBS
from server.output_constraints import structured_output
from server.schemas import MAX_N, Int64
from server.vllm_generate_reply import TokenChunks, prompt_logprobs, usage, whole_choice

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

    def to_engine(self, context_left: int, score_prompt: bool = True) -> SamplingParams:
        """The engine's params; `score_prompt` False leaves prompt_logprobs uncomputed (a stream
        sends none)."""
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
            top_logprobs_num=top, logprob_start_len=0 if score_prompt and self.prompt_logprobs is not None else -1,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            no_stop_trim=self.include_stop_str_in_output, logit_bias=tuple((self.logit_bias or {}).items()),
            **self._constraint(),
        )

    def _constraint(self) -> dict[str, str]:
        """vLLM's `structured_outputs` as the engine's grammar param (server/output_constraints.py)."""
        if self.structured_outputs is None:
            return {}
        where = "sampling_params.structured_outputs"
        found = structured_output(self.structured_outputs, where)
        if len(found) != 1:
            raise InvalidRequest(f"{where} must give one of json, regex, grammar and structural_tag")
        return found


class StreamOptions(BaseModel):
    """vLLM's StreamOptions (include_usage is true when the object is given)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class GenerateIn(BaseModel):
    """vLLM's GenerateRequest (SkyRL: remote_inference_client.py::_generate_single sends
    {sampling_params, model, token_ids})."""

    model_config = ConfigDict(extra="forbid")
    request_id: str | None = None
    token_ids: list[Int64] = Field(min_length=1)
    sampling_params: VllmSampling = Field(default_factory=VllmSampling)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    features: Any = None


@router.post("/inference/v1/generate", response_model=None)
async def generate(body: GenerateIn, request: Request) -> Response:
    client = request.app.state.client
    request.app.state.model_names.check(body.model)
    if body.features is not None or body.priority != 0:
        raise InvalidRequest("multimodal features and priority are not supported")
    sp, prompt = body.sampling_params, list(body.token_ids)
    params = sp.to_engine(max(client.info["max_context_length"] - len(prompt), 1), score_prompt=not body.stream)
    rid = body.request_id or uuid.uuid4().hex
    jobs = make_jobs([prompt], params, sp.n, client, [rid])
    metrics = request.app.state.metrics
    if body.stream:
        opts = body.stream_options
        include = bool(opts is not None and opts.include_usage)
        chunks = TokenChunks(rid, len(prompt), sp.logprobs, include, include and bool(opts and opts.continuous_usage_stats))
        return EventStream(client, metrics, jobs, chunks)
    outs = await run_jobs(client, metrics, jobs, request)
    completion = sum(len(o.output_ids) for o in outs)
    return JSONResponse({
        "request_id": rid, "id": rid, "object": "generate", "created": int(time.time()),
        "model": request.app.state.model_name, "choices": [whole_choice(i, o, sp.logprobs) for i, o in enumerate(outs)],
        "prompt_logprobs": prompt_logprobs(outs[0], prompt, sp.prompt_logprobs, client.tokenizer),
        "usage": usage(len(prompt), completion), "kv_transfer_params": None,
    })
