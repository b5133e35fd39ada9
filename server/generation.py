"""Running requests for the HTTP routes, native and OpenAI alike: prompt checks (a 400 before the
engine sees a bad request), and whole requests to their ends with disconnect handling and
metrics. Streams are `server.event_stream.EventStream`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from engine.client.async_client import AsyncEngineClient
from engine.client.output import Consumer, GenerationOutput, LiveRequest, Waker
from engine.errors import EngineUnavailable, InvalidRequest
from engine.limits import RequestLimits, prompt_error, vocab_error
from engine.request import SAMPLE_SEP, SamplingParams
from server.metrics import Metrics, RequestTracker

T = TypeVar("T")


def _same(out: GenerationOutput) -> Any:
    return out


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests were aborted in the engine."""


@dataclass(frozen=True)
class Job:
    """One engine request: sample `index` of a prompt, with its engine id."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


def check_prompt(ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """The engine's own prompt rules (engine/limits.py), checked before it sees the request, so
    they become 400s with no engine round trip."""
    error = prompt_error(ids, params, limits)
    if error is not None:
        raise InvalidRequest(error)


def check_vocab(ids: list[int], vocab: int) -> None:
    """Every token id in [0, vocab), else `InvalidRequest` naming the first that is not (an id
    the tokenizer is asked to decode before the prompt is checked)."""
    error = vocab_error(ids, vocab)
    if error is not None:
        raise InvalidRequest(error)


def make_jobs(
    prompts: list[list[int]], params: SamplingParams | list[SamplingParams], n: int, client: AsyncEngineClient,
    rids: list[str] | None = None,
) -> list[Job]:
    """n jobs per prompt, prompt-major, with the params given for all prompts or one per prompt.
    Ids: the client's rid (or a fresh one) per prompt, and
    f"{rid}#{i}" for the samples of an n > 1 request, so aborting the rid aborts them all.
    While the engine cannot serve (memory released), raises `EngineUnavailable` (503) at once,
    before any stream starts; a dead engine raises `EngineDeadError` (503) the same way."""
    client.check_alive()
    if client.unavailable is not None:
        raise EngineUnavailable(client.unavailable)
    limits = RequestLimits.from_info(client.info)
    if n < 1:
        raise InvalidRequest(f"n must be >= 1, got {n}")
    if rids is not None and len(rids) != len(prompts):
        raise InvalidRequest(f"{len(rids)} rids for {len(prompts)} prompts")
    each = params if isinstance(params, list) else [params] * len(prompts)
    for ids, prompt_params in zip(prompts, each, strict=True):
        check_prompt(ids, prompt_params, limits)
    jobs = []
    for p, (ids, prompt_params) in enumerate(zip(prompts, each, strict=True)):
        rid = rids[p] if rids is not None else uuid.uuid4().hex
        for i in range(n):
            request_id = rid if n == 1 else f"{rid}{SAMPLE_SEP}{i}"
            jobs.append(Job(index=len(jobs), request_id=request_id, prompt_token_ids=ids, params=_sample_params(prompt_params, i)))
    return jobs


def _sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample i of n with a seed uses seed + i: reproducible, yet the n samples differ."""
    if i == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


def open_job(
    client: AsyncEngineClient, metrics: Metrics, job: Job, every_step: bool, consumer: Consumer
) -> tuple[LiveRequest, RequestTracker]:
    """Register a job with the client, not sent yet (`AsyncEngineClient.submit`), and start its
    metrics; one the client refuses (its id runs already) is recorded as an error and raises."""
    tracker = metrics.tracker()
    try:
        live = client.open(job.request_id, job.prompt_token_ids, job.params, every_step, consumer, tracker.on_tokens)
    except Exception:
        tracker.finish("error", len(job.prompt_token_ids))
        raise
    return live, tracker


async def _run(client: AsyncEngineClient, job: Job, live: LiveRequest, tracker: RequestTracker) -> GenerationOutput:
    """A submitted job (opened with a `Waker`) to its end, its metrics recorded; a cancel aborts it
    in the engine. (Streams are `server.event_stream.EventStream`'s.)"""
    outcome = "disconnected"
    last: GenerationOutput | None = None
    try:
        async for update, out in client.updates(live):
            refusal = out.refusal()
            if refusal is not None:
                raise refusal
            if update.finished:
                outcome = out.finish_reason or "abort"
            last = out
    except EngineUnavailable:
        outcome = "unavailable"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        client.close(live)
        tracker.finish(outcome, len(job.prompt_token_ids))
    assert last is not None  # a job always ends with a finished update
    return last


async def run_jobs(
    client: AsyncEngineClient, metrics: Metrics, jobs: list[Job], request: Request,
    finish: Callable[[GenerationOutput], T] = _same,
) -> list[T]:
    """Run jobs to their ends, concurrently, each output through `finish` as soon as its job
    ends (a response part built while the other jobs still run: only the last to end are built
    after the engine's last step), in the jobs' order; if the HTTP client goes away, abort them
    all and raise `ClientDisconnected`. The jobs go to the engine in one message, added whole
    before its next step (a batch is scheduled alike on every run)."""
    opened: list[tuple[Job, LiveRequest, RequestTracker]] = []
    try:
        for job in jobs:
            opened.append((job, *open_job(client, metrics, job, False, Waker())))
        await client.submit(*(live for _, live, _ in opened))
    except BaseException:
        for job, live, tracker in opened:
            client.close(live)
            tracker.finish("error", len(job.prompt_token_ids))
        raise

    async def one(job: Job, live: LiveRequest, tracker: RequestTracker) -> T:
        return finish(await _run(client, job, live, tracker))

    tasks = [asyncio.ensure_future(one(*o)) for o in opened]
    work = asyncio.gather(*tasks)
    watcher = asyncio.create_task(_wait_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done and work.exception() is None:
            return work.result()
        # A job failed (refused, unavailable) or the client is gone: the other jobs stop too
        # (closing a job aborts it in the engine).
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if work in done:
            return work.result()  # raises the job's error
        raise ClientDisconnected()
    finally:
        watcher.cancel()


async def _wait_disconnected(request: Request) -> None:
    """Returns when the client goes away. The body is read by now, so the next ASGI message is
    the disconnect: wait for it (no polling)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
