"""Profiling routes as SGLang names them: `/start_profile` and `/stop_profile` (GET or POST) run a
`torch.profiler` trace in the engine process (engine/core/profiler.py has the rules).

Both answer JSON (SGLang answers plain text, which its clients only check for a 2xx):
start `{"success", "message", "output_dir", "profile_id", "activities", "start_step", "stop_step"}`,
stop `{"success", "message", "files"}`. A start while a profile runs, or a stop with none, is a
400. They need the admin key when the server has one (they write files on the server's host).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from engine.core import calls
from server.schemas import Int64

router = APIRouter()


class ProfileIn(BaseModel):
    """SGLang's ProfileReq fields; `profile_stages` is accepted and has no effect."""

    output_dir: str | None = None
    start_step: Int64 | None = None
    num_steps: Int64 | None = None
    activities: list[str] | None = None
    profile_by_stage: bool = False
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None



@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, body: ProfileIn | None = None) -> dict[str, Any]:
    args = (body or ProfileIn()).model_dump(exclude={"profile_stages"})
    return await request.app.state.client.call(calls.StartProfile(**args))


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request) -> dict[str, Any]:
    return await request.app.state.client.call(calls.StopProfile())
