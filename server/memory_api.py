"""Memory occupation routes, as SGLang names them: release the engine's GPU memory to an RL
trainer on the same GPU, take it back, and say where it stands (engine/memory/regions.py has the rules)."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.client.async_client import AsyncEngineClient
from engine.core.calls import GetMemoryOccupation, ReleaseMemory, ResumeMemory
from server.errors import error_body
from server.schemas import ReleaseMemoryIn, ResumeMemoryIn

router = APIRouter()

GIB = 1 << 30


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: ReleaseMemoryIn | None = None) -> dict[str, Any]:
    """Answers once the memory is free: in `wait` mode after the running requests finished. New
    requests are refused from the moment the engine takes the call (it owns availability)."""
    body = body or ReleaseMemoryIn()
    answer = await _client(request).call(ReleaseMemory(tags=body.tags, mode=body.mode))
    return msgspec.to_builtins(answer)


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: ResumeMemoryIn | None = None) -> Response:
    """200 once every asked tag is resident. 503 when the device had no room for some (a trainer
    still holds the memory): those stay released, the others resumed, and the body says per tag
    the bytes needed and free; a later resume (or `wait_for_memory_s`) succeeds."""
    body = body or ResumeMemoryIn()
    reply = await _client(request).call(ResumeMemory(tags=body.tags, wait_for_memory_s=body.wait_for_memory_s))
    return resume_answer(msgspec.to_builtins(reply))


def resume_answer(answer: dict[str, Any]) -> JSONResponse:
    """A resume's reply: 200, or 503 naming the tags the device had no room for."""
    if not answer["refused"]:
        return JSONResponse(answer)
    return JSONResponse(error_body(RuntimeError(not_enough_memory(answer["refused"])), "service_unavailable", 503) | answer,
                        status_code=503)


def not_enough_memory(refused: dict[str, dict[str, int]]) -> str:
    parts = [f"{tag} needs {r['bytes_needed'] / GIB:.2f} GiB, {r['bytes_free'] / GIB:.2f} GiB free"
             for tag, r in refused.items()]
    return ("not enough free device memory to resume (" + "; ".join(parts) + "): those tags stay released; "
            "free the memory (torch.cuda.empty_cache() in the trainer) and resume again, or pass wait_for_memory_s")


@router.get("/memory_occupation")
async def memory_occupation(request: Request) -> dict[str, Any]:
    """Every tag's state and bytes, per rank with several; `weights_backup` is the setting,
    `weights_host_copy` / `weights_host_copy_bytes` what holds the weights' host copy now
    (`discarded` and 0 after vLLM's level-2 sleep, until an update has written every tensor)."""
    return await _client(request).call(GetMemoryOccupation())
