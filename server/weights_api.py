"""Weight-update routes, as SGLang names them, for RL trainers: from disk, from tensors (CUDA IPC
or shared memory), and over a process group the trainer broadcasts on. Each answers
`{"success": true, "message", "weight_version", "seconds"}`; a bad update is a 400 naming the
first bad tensor (the old weights stay in use), a path outside --allowed-model-dirs a 403.
`/update_weight_version` only renames the weights in use (`{"success", "message", "new_version"}`).

The three update routes decode their JSON with msgspec straight into their call
(engine/core/calls.py) and encode the reply the same way: they sit on the RL flip's critical path,
and pydantic took ~0.5 ms to validate the 399 names, dtypes and shapes of an 8B model's
update_weights_from_distributed body (bench/RESULTS.md). Their OpenAPI bodies are the calls' own
JSON schemas. The other routes validate with pydantic; tests/test_control_calls.py holds their
models to their calls' fields."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.client.async_client import AsyncEngineClient
from engine.core import calls
from engine.core.calls import DEFAULT_GROUP
from engine.errors import InvalidRequest
from server.schemas import Int64

router = APIRouter()

class InitGroupIn(BaseModel):
    master_address: str
    master_port: Int64
    rank_offset: Int64
    world_size: Int64
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DestroyGroupIn(BaseModel):
    group_name: str = DEFAULT_GROUP


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


C = TypeVar("C", bound=calls.Call)


def _body(call_type: type[calls.Call]) -> dict[str, Any]:
    """The OpenAPI request body of a route that decodes its JSON straight into `call_type`: the
    call's JSON schema, less the fields only its message has (the tag, the call id)."""
    schema = msgspec.json.schema(call_type)["$defs"][call_type.__name__]
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in ("type", "call_id")}
    schema["required"] = [k for k in schema["required"] if k != "type"]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _decoded(request: Request, call_type: type[C]) -> C:
    try:
        return msgspec.json.decode(await request.body(), type=call_type)
    except msgspec.DecodeError as e:  # ValidationError included: a 400 naming the field
        raise InvalidRequest(f"invalid request: {e}") from None


async def _answer(request: Request, call: calls.Call) -> Response:
    return Response(msgspec.json.encode(await _client(request).call(call)), media_type="application/json")


@router.post("/update_weights_from_disk", openapi_extra=_body(calls.UpdateWeightsFromDisk))
async def update_weights_from_disk(request: Request) -> Response:
    return await _answer(request, await _decoded(request, calls.UpdateWeightsFromDisk))


@router.post("/update_weights_from_tensor", openapi_extra=_body(calls.UpdateWeightsFromTensor))
async def update_weights_from_tensor(request: Request) -> Response:
    return await _answer(request, await _decoded(request, calls.UpdateWeightsFromTensor))


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitGroupIn, request: Request) -> Response:
    return await _answer(request, calls.InitWeightsUpdateGroup(**body.model_dump()))


@router.post("/update_weights_from_distributed", openapi_extra=_body(calls.UpdateWeightsFromDistributed))
async def update_weights_from_distributed(request: Request) -> Response:
    return await _answer(request, await _decoded(request, calls.UpdateWeightsFromDistributed))


@router.post("/update_weight_version", openapi_extra=_body(calls.UpdateWeightVersion))
async def update_weight_version(request: Request) -> Response:
    return await _answer(request, await _decoded(request, calls.UpdateWeightVersion))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request, body: DestroyGroupIn | None = None) -> Response:
    call = calls.DestroyWeightsUpdateGroup(**(body or DestroyGroupIn()).model_dump())
    getattr(request.app.state, "group_timeouts", {}).pop(call.group_name, None)  # see server/vllm_weights_api.py
    return await _answer(request, call)
