"""Weight-update routes, as SGLang names them, for RL trainers: from disk, from tensors (CUDA IPC
or shared memory), and over a process group the trainer broadcasts on. Each answers
`{"success": true, "message", "weight_version", "seconds"}`; a bad update is a 400 naming the
first bad tensor (the old weights stay in use), a path outside --allowed-model-dirs a 403."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel

from engine.client.async_client import AsyncEngineClient
from engine.core import calls
from engine.core.calls import DEFAULT_GROUP
from server.schemas import Int64, WeightVersion

router = APIRouter()

class UpdateFromDiskIn(BaseModel):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None  # a string or an integer (slime), kept as a string


class UpdateFromTensorIn(BaseModel):
    serialized_named_tensors: list[str]  # one base64 payload per tensor-parallel rank
    load_format: str | None = None  # null | "direct" | "flattened_bucket"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None  # a string or an integer (slime), kept as a string


class InitGroupIn(BaseModel):
    master_address: str
    master_port: Int64
    rank_offset: Int64
    world_size: Int64
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class UpdateFromDistributedIn(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Int64]]
    group_name: str = DEFAULT_GROUP
    load_format: str | None = None  # null: one broadcast per tensor | "flattened_bucket": one in all
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None  # a string or an integer (slime), kept as a string


class DestroyGroupIn(BaseModel):
    group_name: str = DEFAULT_GROUP


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


async def _answer(request: Request, call: calls.Call) -> dict[str, Any]:
    return msgspec.to_builtins(await _client(request).call(call))


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateFromDiskIn, request: Request) -> dict[str, Any]:
    return await _answer(request, calls.UpdateWeightsFromDisk(**body.model_dump()))


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(body: UpdateFromTensorIn, request: Request) -> dict[str, Any]:
    return await _answer(request, calls.UpdateWeightsFromTensor(**body.model_dump()))


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupIn, request: Request) -> dict[str, Any]:
    return await _answer(request, calls.InitWeightsUpdateGroup(**body.model_dump()))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateFromDistributedIn, request: Request) -> dict[str, Any]:
    return await _answer(request, calls.UpdateWeightsFromDistributed(**body.model_dump()))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, body: DestroyGroupIn | None = None) -> dict[str, Any]:
    return await _answer(request, calls.DestroyWeightsUpdateGroup(**(body or DestroyGroupIn()).model_dump()))
