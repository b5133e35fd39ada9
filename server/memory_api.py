"""Memory occupation routes, as SGLang names them: release the engine's GPU memory to an RL
trainer on the same GPU, take it back, and say where it stands (engine/memory.py has the rules)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from engine.async_client import AsyncEngineClient
from server.schemas import ReleaseMemoryIn, ResumeMemoryIn

router = APIRouter()


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: ReleaseMemoryIn | None = None) -> dict[str, Any]:
    """Answers once the memory is free: in `wait` mode after the running requests finished."""
    body = body or ReleaseMemoryIn()
    client = _client(request)
    # Refuse new requests from now on, not only once the release is done.
    client.unavailable = "memory is being released"
    try:
        return await client.memory_call("release_memory_occupation", tags=body.tags, mode=body.mode)
    finally:
        if client.unavailable == "memory is being released":  # the call failed: nothing changed
            client.unavailable = None


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: ResumeMemoryIn | None = None) -> dict[str, Any]:
    body = body or ResumeMemoryIn()
    return await _client(request).memory_call("resume_memory_occupation", tags=body.tags)


@router.get("/memory_occupation")
async def memory_occupation(request: Request) -> dict[str, Any]:
    return await _client(request).call("memory_occupation")
