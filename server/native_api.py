"""SGLang-native routes: `/generate`, health, model and server info, metrics, and the control routes
(abort, flush, pause, continue). Field names and shapes are SGLang's so RL clients work unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.client.async_client import AsyncEngineClient
from engine.client.output import GenerationOutput
from engine.core import calls
from engine.errors import InvalidRequest
from engine.request import SamplingParams
from server.errors import error_body, service_unavailable
from server.event_stream import Batch, EventStream
from server.generation import Job, make_jobs, run_jobs
from server.json_parts import JsonParts
from server.schemas import AbortRequestIn, GenerateRequest, PauseGenerationIn
from server.text_input import encode_text
from server.token_text import TokenText

router = APIRouter()

# /generate's bodies and events: msgspec encodes the long id and logprob lists several times
# faster than json. Non-finite floats become null, as SGLang's orjson writes them.
_JSON = msgspec.json.Encoder()

# /health waits this long for the engine to answer; /health_generate this long for its token.
HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


def _prompts(client: AsyncEngineClient, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt, and whether the request was a batch (list in, list out)."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("give exactly one of `text` and `input_ids`")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise InvalidRequest("`text` is an empty list")
        return [encode_text(client.tokenizer, t, client.info["max_context_length"]) for t in texts], not isinstance(body.text, str)
    ids = body.input_ids
    if ids and isinstance(ids[0], list):
        return [list(x) for x in ids], True
    return [list(ids)], False


def meta_info(
    out: GenerationOutput, weight_version: str, text: TokenText | None = None, routes: bool = True
) -> dict[str, Any]:
    """SGLang's meta_info; logprob entries are [logprob, token id, the token's text or None]
    (`text`: SGLang's return_text_in_logprobs); `routes` False leaves the routed experts out."""

    def name(tok: int) -> str | None:
        return text(tok) if text is not None else None

    reason: dict[str, Any] = {"type": out.finish_reason, "matched": out.matched_stop}
    if out.finish_reason == "length":
        reason["length"] = len(out.output_ids)
    message = out.error if out.error is not None else out.abort_message
    if message is not None:  # a refusal says why, an abort what aborted it (SGLang's message)
        reason["message"] = message
    meta: dict[str, Any] = {
        "id": out.request_id,
        "finish_reason": reason if out.finish_reason is not None else None,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "e2e_latency": out.e2e_latency,
        "weight_version": weight_version,
    }
    # Tuples, not lists: msgspec writes both as JSON arrays, and a tuple of atoms costs the
    # allocator and the collector less (a 1024 x 256-token batch's response builds in half the time).
    if out.output_token_logprobs is not None:
        meta["output_token_logprobs"] = [(lp, tok, name(tok)) for lp, tok in out.output_token_logprobs]
    if out.input_token_logprobs is not None:
        meta["input_token_logprobs"] = [(lp, tok, name(tok)) for lp, tok in out.input_token_logprobs]
    if out.routed_experts is not None:  # the integers of its bytes, as SGLang names them (its reader: int32 if absent)
        meta["routed_experts_dtype"] = out.routed_experts_dtype
    if out.output_top_logprobs is not None:
        meta["output_top_logprobs"] = [[[lp, tok, name(tok)] for tok, lp in row] for row in out.output_top_logprobs]
    if routes and out.routed_experts_base64 is not None:  # encoded as the rows arrived: a JSON string as is
        meta["routed_experts"] = msgspec.Raw(b'"' + out.routed_experts_base64.value() + b'"')
    elif routes and out.routed_experts is not None:
        meta["routed_experts"] = base64.b64encode(out.routed_experts).decode("ascii")
    if out.input_top_logprobs is not None:
        meta["input_top_logprobs"] = [None if row is None else [[lp, tok, name(tok)] for tok, lp in row]
                                      for row in out.input_top_logprobs]
    return meta


def _result(
    out: GenerationOutput, weight_version: str, text: TokenText | None = None, routes: bool = True
) -> dict[str, Any]:
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta_info(out, weight_version, text, routes)}


def _answer(out: GenerationOutput, weight_version: str, text: TokenText | None) -> list[bytes]:
    """One non-streamed answer's JSON in pieces (server/json_parts.py). Its routed experts are
    meta_info's last key, in the base64 pieces made as their rows arrived, never joined here."""
    routes = out.routed_experts_base64
    body = _JSON.encode(_result(out, weight_version, text, routes=routes is None))
    if routes is None:
        return [body]
    assert body.endswith(b"}}"), "meta_info is the result's last key"
    return [body[:-2], b',"routed_experts":"', *routes.pieces(), b'"}}']


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    client = _client(request)
    prompts, is_batch = _prompts(client, body)
    each = body.per_prompt(len(prompts), is_batch)
    jobs = make_jobs(prompts, each.params, each.n, client, body.rids(len(prompts), is_batch))
    version = client.info.get("weight_version", "default")
    metrics = request.app.state.metrics
    text = TokenText(client.tokenizer) if body.return_text_in_logprobs else None
    if body.stream:
        intervals = [each.stream_intervals[job.index // each.n] for job in jobs]
        return EventStream(client, metrics, jobs, _NativeEvents(jobs, version, len(jobs) > 1, intervals, text))
    # Each job's JSON as it ends; the body is the answers (a list for a batch or n > 1).
    answers = await run_jobs(client, metrics, jobs, request, lambda o: _answer(o, version, text))
    return JsonParts(answers, array=is_batch or len(answers) > 1)


class _NativeEvents:
    """/generate's stream: one `data:` event per `intervals[j]` tokens of job j (and at its end),
    with the text and ids so far (as SGLang streams them), "index" when there are several jobs."""

    def __init__(self, jobs: list[Job], version: str, indexed: bool, intervals: list[int], text: TokenText | None) -> None:
        self.writers = [_EventWriter(job, version, indexed, text) for job in jobs]
        self.intervals = intervals
        self.unsent = [0] * len(jobs)  # job index -> tokens since its last event

    def first(self) -> bytes:
        return b""

    def render(self, batch: Batch) -> bytes:
        events = []
        for job, update, out in batch:
            writer = self.writers[job.index]
            if update.finished:
                events.append(writer.whole(out))
                continue
            writer.add(out)
            n = self.unsent[job.index] + len(update.token_ids)
            if n >= self.intervals[job.index]:
                n = 0
                events.append(writer.event(out))
            self.unsent[job.index] = n
        return b"".join(events)

    def end(self, outs: dict[int, GenerationOutput]) -> bytes:
        return b""


class _EventWriter:
    """The events of one streamed job, byte for byte `data: ` + the JSON of `_result` (+ "index").
    Its text and ids so far are kept JSON-encoded and grow by what each update adds, so an event
    costs about what it adds, not all it holds. Events with logprobs, and the last, are encoded
    whole."""

    def __init__(self, job: Job, version: str, indexed: bool, text: TokenText | None = None) -> None:
        self.job, self.version, self.indexed, self.token_text = job, version, indexed, text
        self.text, self.ids = bytearray(), bytearray()  # JSON of the text (unquoted), of the ids (no brackets)
        self.num_chars = self.num_ids = 0
        self.meta = b'],"meta_info":{"id":%s,"finish_reason":null,"prompt_tokens":%d,"completion_tokens":' % (
            _JSON.encode(job.request_id), len(job.prompt_token_ids))
        self.tail = b',"weight_version":' + _JSON.encode(version) + b"}" + (b',"index":%d' % job.index if indexed else b"") + b"}\n\n"

    def add(self, out: GenerationOutput) -> None:
        """Take in what `out` gained (its text and ids only grow), sent or not."""
        text, ids = out.text, out.output_ids
        if len(text) > self.num_chars:
            self.text += _JSON.encode(text[self.num_chars :])[1:-1]
            self.num_chars = len(text)
        if len(ids) > self.num_ids:
            if self.num_ids:
                self.ids += b","
            self.ids += _JSON.encode(ids[self.num_ids :])[1:-1]
            self.num_ids = len(ids)

    def event(self, out: GenerationOutput) -> bytes:
        if out.output_token_logprobs is not None or out.output_top_logprobs is not None or out.input_token_logprobs is not None:
            return self.whole(out)
        counts = b'%d,"cached_tokens":%d,"e2e_latency":' % (self.num_ids, out.cached_tokens)
        return b"".join((b'data: {"text":"', self.text, b'","output_ids":[', self.ids, self.meta, counts,
                         _JSON.encode(out.e2e_latency), self.tail))

    def whole(self, out: GenerationOutput) -> bytes:
        chunk = _result(out, self.version, self.token_text)
        if self.indexed:
            chunk["index"] = self.job.index
        return b"data: " + _JSON.encode(chunk) + b"\n\n"


@router.get("/health")
async def health(request: Request) -> Response:
    client = _client(request)
    try:
        memory = await client.call(calls.Ping(), timeout=HEALTH_TIMEOUT_S)
    except Exception as e:
        return service_unavailable(f"engine is not answering: {client.dead or type(e).__name__}")
    return JSONResponse({"status": "ok", "memory": memory})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    client = _client(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    job = Job(index=0, request_id=f"health-{uuid.uuid4().hex}", prompt_token_ids=[0], params=params)
    try:
        outs = await _with_timeout(run_jobs(client, request.app.state.metrics, [job], request))
    except TimeoutError:
        await client.abort(job.request_id)
        return service_unavailable(f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s")
    if len(outs[0].output_ids) != 1:
        return service_unavailable(f"health generation ended with {outs[0].finish_reason}: {outs[0].error}")
    return Response(status_code=200)


async def _with_timeout(coro: Any) -> Any:
    return await asyncio.wait_for(coro, HEALTH_GENERATE_TIMEOUT_S)


@router.get("/model_info")  # SGLang's newer name; the gateway (smg) asks it first
@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    info = await _client(request).call(calls.GetInfo())
    keys = ("model_path", "architecture", "dtype", "max_context_length", "weight_version")
    extra = {"tokenizer_path": info["model_path"], "is_generation": True, "architectures": [info["architecture"]]}
    return {k: info[k] for k in keys} | extra


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    info = await _client(request).call(calls.GetInfo())
    return Response(request.app.state.metrics.render(info), media_type="text/plain; version=0.0.4")


@router.post("/abort_request")
async def abort_request(body: AbortRequestIn, request: Request) -> dict[str, Any]:
    if not body.abort_all and body.rid is None:
        raise InvalidRequest("give `rid` or `abort_all: true`")
    if body.abort_all and not request.state.is_admin:
        raise PermissionError("abort_all needs the admin key (--admin-api-key)")
    n = await _client(request).abort(None if body.abort_all else body.rid)
    return {"success": True, "num_aborted": n}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    if await _client(request).call(calls.FlushCache()):
        return JSONResponse({"success": True, "message": "prefix cache flushed"})
    return JSONResponse(
        error_body(InvalidRequest("cannot flush the cache while requests are running")), status_code=400
    )


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseGenerationIn | None = None) -> dict[str, Any]:
    mode = body.mode if body is not None else "abort"
    return {"success": True} | msgspec.to_builtins(await _client(request).call(calls.PauseGeneration(mode=mode)))


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    return {"success": True} | msgspec.to_builtins(await _client(request).call(calls.ContinueGeneration()))
