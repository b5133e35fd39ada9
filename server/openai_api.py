"""OpenAI-compatible routes: `/v1/models`, `/v1/completions` and `/v1/chat/completions`, whole or
streamed (SSE), so the official `openai` client works unchanged.

Rules:
- Choices are prompt-major: choice `prompt_i * n + sample_j`, as OpenAI orders them.
- The engine ids of a response are its id ("cmpl-..." / "chatcmpl-..."), suffixed "-{prompt_i}"
  when a completion has several prompts; /abort_request takes them.
- max_tokens left null fills what the (longest) prompt leaves of the context, as vLLM does.
- A stream sends `data: {chunk}` events, a final chunk per choice with its finish_reason, the
  usage chunk when `stream_options.include_usage`, then `data: [DONE]`; a failure after the
  status line went out is an in-band error event (`{"error": {...}}`) before [DONE].
Response shapes (choices, usage, logprobs) are `server.openai_reply.Reply`'s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.async_client import AsyncEngineClient
from engine.output import GenerationOutput
from engine.request import InvalidRequest
from server.errors import error_body
from server.generation import EventStream, make_jobs, run_jobs, stream_jobs
from server.metrics import Metrics
from server.openai_reply import Reply
from server.openai_schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1")

_STARTED = int(time.time())


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    client = _client(request)
    model = {
        "id": request.app.state.model_name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "siesta",
        "root": client.config.model,
        "max_model_len": client.info["max_context_length"],
    }
    return {"object": "list", "data": [model]}


def _rids(reply_id: str, num_prompts: int) -> list[str]:
    return [reply_id] if num_prompts == 1 else [f"{reply_id}-{p}" for p in range(num_prompts)]


def _fill_context(prompts: list[list[int]], limit: int) -> int:
    """max_tokens when the client gave none: what the longest prompt leaves of the context."""
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise InvalidRequest(f"the prompt ({longest} tokens) leaves no room in the context length of {limit} tokens")
    return limit - longest


# ---- completions --------------------------------------------------------------------------------


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    client = _client(request)
    body.check_supported()
    prompts, echo = body.prompts(client.tokenizer, client.info)
    limit = client.info["max_context_length"]
    max_new = body.max_tokens if body.max_tokens is not None else _fill_context(prompts, limit)
    want_lp = body.logprobs is not None
    params = body.sampling_params(max_new, logprobs=want_lp, top_logprobs_num=body.logprobs or 0)
    rid = f"cmpl-{uuid.uuid4().hex}"
    jobs = make_jobs(prompts, params, body.n, client, _rids(rid, len(prompts)))
    reply = Reply(rid, "text_completion", request.app.state.model_name, client.tokenizer, jobs, body.n,
                  logprobs=want_lp, include_usage=body.stream and body.include_usage)
    prefix = {j.index: echo[j.index // body.n] for j in jobs} if echo is not None else {}
    metrics = request.app.state.metrics
    if body.stream:
        return _streaming(_completion_chunks(reply, client, metrics, prefix))
    outs = await run_jobs(client, metrics, jobs, request)
    return JSONResponse(reply.full(outs, prefix))


async def _completion_chunks(
    reply: Reply, client: AsyncEngineClient, metrics: Metrics, prefix: dict[int, str]
) -> AsyncIterator[dict[str, Any]]:
    for index, text in prefix.items():  # echo: the prompt comes first
        yield reply.echo_chunk(index, text)
    async for chunk in _choice_chunks(reply, client, metrics):
        yield chunk


# ---- chat completions ---------------------------------------------------------------------------


def chat_prompt(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids from the tokenizer's chat template; 400 when there is no template or
    it fails on these messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("the model's tokenizer has no chat template: use /v1/completions with a prompt")
    messages = body.template_messages()
    kwargs = dict(body.chat_template_kwargs or {})
    kwargs |= {"add_generation_prompt": body.add_generation_prompt,
               "continue_final_message": body.continue_final_message, "tokenize": True}
    try:
        ids = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # the template sees only the request: its failures are the request's
        raise InvalidRequest(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    client = _client(request)
    body.check_supported()
    prompt = chat_prompt(client.tokenizer, body)
    max_new = body.max_new_tokens
    if max_new is None:
        max_new = _fill_context([prompt], client.info["max_context_length"])
    want_lp = bool(body.logprobs)
    params = body.sampling_params(max_new, logprobs=want_lp, top_logprobs_num=body.top_logprobs or 0)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = make_jobs([prompt], params, body.n, client, [rid])
    kind = "chat.completion.chunk" if body.stream else "chat.completion"
    reply = Reply(rid, kind, request.app.state.model_name, client.tokenizer, jobs, body.n,
                  logprobs=want_lp, include_usage=body.stream and body.include_usage)
    metrics = request.app.state.metrics
    if body.stream:
        return _streaming(_chat_chunks(reply, client, metrics))
    outs = await run_jobs(client, metrics, jobs, request)
    return JSONResponse(reply.full(outs))


async def _chat_chunks(reply: Reply, client: AsyncEngineClient, metrics: Metrics) -> AsyncIterator[dict[str, Any]]:
    for job in reply.jobs:  # each choice opens with the assistant's role
        yield reply.role_chunk(job.index)
    async for chunk in _choice_chunks(reply, client, metrics):
        yield chunk


# ---- streaming ----------------------------------------------------------------------------------


async def _choice_chunks(reply: Reply, client: AsyncEngineClient, metrics: Metrics) -> AsyncIterator[dict[str, Any]]:
    """A chunk per update that has new text, new logprobs, or ends its choice; then usage."""
    outs: dict[int, GenerationOutput] = {}
    async with aclosing(stream_jobs(client, metrics, reply.jobs)) as updates:
        async for job, update, out in updates:
            outs[job.index] = out
            if update.text or update.finished or (reply.logprobs and update.token_ids):
                yield reply.chunk([reply.choice(job.index, update.text, out, update.finished)])
    if reply.include_usage:
        yield reply.body([], usage=reply.usage(outs))


def _streaming(chunks: AsyncIterator[dict[str, Any]]) -> EventStream:
    return EventStream(_sse(chunks))


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE events, then [DONE]. A client gone away closes this, which closes `chunks` and so
    aborts its jobs."""
    async with aclosing(chunks):
        try:
            async for data in chunks:
                yield f"data: {json.dumps(data)}\n\n"
        except Exception as e:  # the status line is sent already: report in-band
            yield f"data: {json.dumps(error_body(e))}\n\n"
    yield "data: [DONE]\n\n"

