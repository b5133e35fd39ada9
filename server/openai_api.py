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
- `model` must be one the server serves, or none (server/model_names.py); another is a 404
  `model_not_found`.
Response shapes (choices, usage, logprobs) are `server.openai_reply.Reply`'s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.client.async_client import AsyncEngineClient
from engine.client.output import GenerationOutput
from engine.errors import InvalidRequest
from server.event_stream import Batch, EventStream, event
from server.generation import make_jobs, run_jobs
from server.openai_reply import Reply
from server.openai_schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1")

_STARTED = int(time.time())


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    """Every served name (server/model_names.py), the first first."""
    client = _client(request)
    models = [{
        "id": name,
        "object": "model",
        "created": _STARTED,
        "owned_by": "sglang",  # the runtime the SGLang Model Gateway detects from data[0] (docs/SMG_GATEWAY.md)
        "root": client.config.model,
        "max_model_len": client.info["max_context_length"],
    } for name in request.app.state.model_names.served]
    return {"object": "list", "data": models}


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
    request.app.state.model_names.check(body.model)
    body.check_supported()
    prompts, echo = body.prompts(client.tokenizer, client.info)
    limit = client.info["max_context_length"]
    max_new = body.max_tokens if body.max_tokens is not None else _fill_context(prompts, limit)
    want_lp = body.logprobs is not None
    # echo with logprobs scores the prompt too: its tokens' logprobs and top alternatives from position 0.
    score_prompt = want_lp and echo is not None
    params = body.sampling_params(max_new, logprobs=want_lp, top_logprobs_num=body.logprobs or 0,
                                  logprob_start_len=0 if score_prompt else -1, constraint=body.constraint())
    rid = f"cmpl-{uuid.uuid4().hex}"
    jobs = make_jobs(prompts, params, body.n, client, _rids(rid, len(prompts)))
    reply = Reply(rid, "text_completion", request.app.state.model_name, client.tokenizer, jobs, body.n,
                  logprobs=want_lp, include_usage=body.stream and body.include_usage, prompt_logprobs=score_prompt,
                  return_token_ids=body.return_token_ids)
    prefix = {j.index: echo[j.index // body.n] for j in jobs} if echo is not None else {}
    metrics = request.app.state.metrics
    if body.stream:
        return EventStream(client, metrics, jobs, _ChoiceEvents(reply, prefix))
    # Each choice is built as its job ends (its logprobs' texts too), not after the last one.
    choices = await run_jobs(client, metrics, jobs, request, lambda o: reply.whole_choice(o, prefix))
    return JSONResponse(reply.full(choices))


# ---- chat completions ---------------------------------------------------------------------------


def chat_prompt(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids from the tokenizer's chat template; 400 when there is no template or
    it fails on these messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequest("the model's tokenizer has no chat template: use /v1/completions with a prompt")
    messages = body.template_messages()
    kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        kwargs["tools"] = body.tools
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
    request.app.state.model_names.check(body.model)
    body.check_supported()
    prompt = chat_prompt(client.tokenizer, body)
    max_new = body.max_new_tokens
    if max_new is None:
        max_new = _fill_context([prompt], client.info["max_context_length"])
    want_lp = bool(body.logprobs)
    params = body.sampling_params(max_new, logprobs=want_lp, top_logprobs_num=body.top_logprobs or 0,
                                  constraint=body.constraint())
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = make_jobs([prompt], params, body.n, client, [rid])
    kind = "chat.completion.chunk" if body.stream else "chat.completion"
    reply = Reply(rid, kind, request.app.state.model_name, client.tokenizer, jobs, body.n,
                  logprobs=want_lp, include_usage=body.stream and body.include_usage, tools=body.tool_choice_of(request.app.state.server_config.tool_call_parser),
                  return_token_ids=body.return_token_ids)
    metrics = request.app.state.metrics
    if body.stream:
        return EventStream(client, metrics, jobs, _ChoiceEvents(reply, {}))
    choices = await run_jobs(client, metrics, jobs, request, reply.whole_choice)
    return JSONResponse(reply.full(choices))


# ---- streaming ----------------------------------------------------------------------------------


class _ChoiceEvents:
    """A stream's chunks: each choice opens with the assistant's role (chat) or its echoed
    prompt (completions with echo); then a chunk per update that has new text, new logprobs, or
    ends its choice; then usage when asked for. An echo with logprobs waits for the prompt's
    logprobs: it opens with the choice's first update, in one chunk with it (as vLLM sends it)."""

    def __init__(self, reply: Reply, prefix: dict[int, str]) -> None:
        self.reply, self.prefix = reply, prefix
        self.unechoed = dict(prefix) if reply.prompt_logprobs else {}  # choice -> its prompt text, not sent yet

    def first(self) -> bytes:
        reply = self.reply
        if reply.chat:
            return b"".join(event(reply.role_chunk(job.index)) for job in reply.jobs)
        if self.unechoed:
            return b""
        return b"".join(event(reply.echo_chunk(index, text)) for index, text in self.prefix.items())

    def render(self, batch: Batch) -> bytes:
        reply, events = self.reply, []
        for job, update, out in batch:
            prompt_text = self.unechoed.pop(job.index, None)
            if prompt_text is not None:
                events.append(event(reply.echo_chunk(job.index, prompt_text, update.text, out, update.finished)))
            elif update.text or update.finished or (reply.logprobs and update.token_ids):
                events.append(event(reply.chunk([reply.choice(job.index, update.text, out, update.finished)])))
        return b"".join(events)

    def end(self, outs: dict[int, GenerationOutput]) -> bytes:
        return event(self.reply.body([], usage=self.reply.usage(outs))) if self.reply.include_usage else b""
