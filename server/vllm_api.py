"""vLLM's RL control routes (its dev-mode routes, which SkyRL, prime-rl, TRL and NeMo-RL call), each
a thin translation onto the engine's calls (engine/core/calls.py), so both dialects share one
engine state: a `/sleep` is a release that `/memory_occupation` sees, a `/pause` is a
pause_generation that `/continue_generation` ends, and the other way round.

Rules:
- Parameters come as vLLM reads them, from the query (`/sleep?level=2&mode=wait`,
  `/wake_up?tags=weights&tags=kv_cache`, `/pause?mode=keep&clear_cache=false`); SkyRL sends the
  same names as a JSON body (`{"level": 2, "tags": [...]}`), which is read too. The query wins.
- A bad value is a 400 naming it. Answers are vLLM's (`{"status": "paused"}`, `{"is_sleeping"}`),
  with the engine's reply beside them.
- `/sleep` level 1 keeps the weights in the host copy (a release); level 2 discards them and
  frees the host copy too (its RAM goes back to the trainer: `host_bytes_freed` in the answer,
  `weights_host_copy: discarded` in `/memory_occupation`). They come back only from weight
  updates: until every tensor is written again a wake of anything but `weights` is a 400 (vLLM's
  order: wake weights, update, wake the rest); once it is, the host copy is made again from the
  device (engine/weights/store.py `refresh_host`), so a later level 1 restores without an
  update. `mode` (vLLM's, default abort): `abort` ends the requests in flight, `wait` lets them
  finish first, `keep` freezes them; they continue after the wake.
- `/pause` modes: `abort`, `wait` (admit nothing new, answer once the running requests
  finished), `keep` (SGLang's in_place: frozen where they are, they continue after `/resume`,
  across a weight update too). `clear_cache` drops the prefix cache (vLLM's default: true).
- `/sleep`, `/pause` and `/init_weight_transfer_engine` are left out of the OpenAPI schema (vLLM
  serves them only in its dev mode): each changes what the server serves until a later call;
  tests/test_vllm_api.py covers their bad input.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from engine.client.async_client import AsyncEngineClient
from engine.core import calls
from engine.errors import InvalidRequest

router = APIRouter()

SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("abort", "wait", "keep")
# vLLM's pause modes -> the engine's (vLLM's keep is SGLang's in_place).
PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "in_place"}


class SleepIn(BaseModel):
    """SkyRL's body (remote_inference_client.py::sleep); vLLM reads the query."""

    model_config = ConfigDict(extra="forbid")
    level: int | None = None
    tags: list[str] | None = None
    mode: str | None = None


class WakeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None


class ResetPrefixCacheIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reset_running_requests: bool = False
    reset_external: bool = False


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


async def _body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as `model` (an empty or absent body: its defaults); a bad one is a 400."""
    raw = await request.body()
    if not raw.strip():
        return model()
    try:
        return model.model_validate(json.loads(raw))
    except (ValueError, TypeError) as e:  # JSONDecodeError and pydantic's ValidationError
        raise InvalidRequest(f"invalid request body: {e}") from None


def _pick(query: Any, body: Any, default: Any) -> Any:
    return query if query is not None else body if body is not None else default


def _one_of(name: str, value: Any, valid: tuple | dict) -> Any:
    if value not in valid:
        raise InvalidRequest(f"{name} must be one of {', '.join(map(str, valid))}, got {value!r}")
    return value


@router.post("/sleep", include_in_schema=False)
async def sleep(
    request: Request, level: Annotated[int | None, Query()] = None, mode: Annotated[str | None, Query()] = None,
    tags: Annotated[list[str] | None, Query()] = None,
) -> dict[str, Any]:
    body = await _body(request, SleepIn)
    level = _one_of("level", _pick(level, body.level, 1), SLEEP_LEVELS)
    mode = _one_of("mode", _pick(mode, body.mode, "abort"), SLEEP_MODES)
    tags = _pick(tags or None, body.tags, None)
    client = _client(request)
    if mode == "keep":  # frozen, then retracted by the release (they stay queued): they run after the wake
        paused_before = client.state.paused
        await client.call(calls.PauseGeneration(mode="in_place"))
    release = calls.ReleaseMemory(tags=tags, mode="wait" if mode == "keep" else mode, discard_weights=level == 2)
    try:
        reply = await client.call(release)
    finally:
        if mode == "keep" and not paused_before:
            await client.call(calls.ContinueGeneration())
    return {"status": "sleeping", "level": level, "mode": mode} | msgspec.to_builtins(reply)


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
    """A resume of the tags (none: all). A tag the device has no room for stays released: 503
    naming the bytes, as `/resume_memory_occupation`."""
    from server.memory_api import resume_answer

    body = await _body(request, WakeIn)
    reply = await _client(request).call(calls.ResumeMemory(tags=_pick(tags or None, body.tags, None)))
    return resume_answer(msgspec.to_builtins(reply))


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, Any]:
    """Sleeping while any tag is released; `released_tags` says which."""
    info = await _client(request).call(calls.GetInfo())
    return {"is_sleeping": bool(info["released_tags"]), "released_tags": info["released_tags"]}


@router.post("/pause", include_in_schema=False)
async def pause(
    request: Request, mode: Annotated[str, Query()] = "abort", clear_cache: Annotated[bool, Query()] = True,
    wait_for_inflight_requests: Annotated[bool, Query()] = False,
) -> dict[str, Any]:
    """vLLM's /pause (its pause/api_router.py); `wait_for_inflight_requests` is its old name for
    mode=wait."""
    mode = "wait" if wait_for_inflight_requests else _one_of("mode", mode, PAUSE_MODES)
    reply = await _client(request).call(calls.PauseGeneration(mode=PAUSE_MODES[mode], clear_cache=clear_cache))
    return {"status": "paused"} | msgspec.to_builtins(reply) | {"mode": mode}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    return {"status": "resumed"} | msgspec.to_builtins(await _client(request).call(calls.ContinueGeneration()))


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, Any]:
    return {"is_paused": (await _client(request).call(calls.GetInfo()))["paused"]}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request, reset_running_requests: Annotated[bool | None, Query()] = None, reset_external: Annotated[bool | None, Query()] = None,
) -> dict[str, Any]:
    """Every prefix hash dropped; with `reset_running_requests`, the requests holding KV
    recompute it (vLLM's preemption). `reset_external` (a KV connector's cache) has nothing here."""
    body = await _body(request, ResetPrefixCacheIn)
    running = _pick(reset_running_requests, body.reset_running_requests, False)
    n = await _client(request).call(calls.ResetPrefixCache(reset_running_requests=running))
    return {"status": "ok", "num_reset_requests": n}


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: Annotated[bool, Query()] = True) -> dict[str, int]:
    """The ranks a weight broadcast reaches: the tensor-parallel size (no data parallelism here)."""
    return {"world_size": int(_client(request).info["tp_size"])}


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> JSONResponse:
    """vLLM runs a method on every worker; there are no vLLM workers here: a 400 naming it."""
    try:
        method = json.loads(await request.body() or b"{}").get("method")
    except (ValueError, AttributeError):
        method = None
    raise InvalidRequest(
        f"collective_rpc cannot run {method!r}: this server has no vLLM workers to call; use its routes instead "
        "(/update_weights, /init_weight_transfer_engine, /sleep, /wake_up, /pause, /reset_prefix_cache)"
    )
