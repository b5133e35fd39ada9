"""vLLM's weight-transfer routes and prime-rl's, translated onto the engine's weight updates
(engine/core/weight_calls.py), so an update through them is the same update as SGLang's.

- `/init_weight_transfer_engine {init_info: {master_address, master_port, rank_offset,
  world_size}}` (vLLM's NCCL backend) joins the trainer's group under the group name VLLM_GROUP:
  on a GPU by vLLM's own wire (StatelessProcessGroup's store, PyNccl's unique id:
  engine/weights/vllm_nccl.py), so a trainer running vLLM's `trainer_init` finds it; on a CPU
  (no NCCL) over gloo as `init_weights_update_group` does (engine/weights/groups.py). A second
  init replaces the group (a trainer that restarts, SkyRL's override_existing_receiver).
- `/update_weights {update_info: {names, dtype_names, shapes, packed}}` receives the trainer's
  broadcasts in that group: one per tensor, or `packed` (vLLM's packed_tensor.py buckets of its
  default 1 GiB; another `packed_buffer_size_bytes` is a 400). `update_info.ipc_handles_pickled`
  (vLLM's CUDA-IPC backend over HTTP) is an update from tensors (engine/weights/payload.py
  "vllm_ipc": each rank rebuilds its GPU's handles).
- `/update_weights {weight_dir}` (prime-rl's filesystem broadcast) loads that checkpoint
  directory, as `/update_weights_from_disk`.
- Neither names a weight version: the engine keeps its own. The prefix cache is flushed (its KV
  is of the old weights); requests frozen by `/pause?mode=keep` keep theirs and continue.
- `/start_weight_update` and `/finish_weight_update` (vLLM's newer lifecycle, TRL's client)
  answer at once: every update above is whole by itself.
- `/init_broadcaster {host, port, rank_offset, inference_world_size, timeout}` (prime-rl's NCCL
  broadcaster: its trainer runs vLLM's `trainer_init`) joins that group as rank rank_offset + 1
  (+ the tensor-parallel rank; rank 0 is the trainer) of inference_world_size + 1, under
  PRIME_GROUP. From then on `/update_weights {weight_dir}` receives over it, as prime-rl's
  trainer sends (NCCLWeightBroadcastSender._broadcast_native_weights): it waits for
  `weight_dir/NCCL_MANIFEST.json` ({"num_chunks"}), then for each chunk's
  `NCCL_CHUNK_{i}.json` ({names, dtype_names, shapes}, written just before that chunk's
  per-tensor broadcasts) and receives the chunk; each wait is bounded by `timeout`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.client.async_client import AsyncEngineClient
from engine.core import calls
from engine.errors import InvalidRequest
from server.schemas import Int64

router = APIRouter()

VLLM_GROUP = "vllm_weight_transfer"
PRIME_GROUP = "prime_rl_broadcaster"
PRIME_MANIFEST, PRIME_CHUNK = "NCCL_MANIFEST.json", "NCCL_CHUNK_{}.json"  # prime_rl/utils/client.py
MANIFEST_POLL_S = 0.02
PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES (engine/weights/updater.py)


class NcclInitInfo(BaseModel):
    """vLLM's NCCLWeightTransferInitInfo (SkyRL: BroadcastInitInfo.to_api_payload)."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: Int64
    rank_offset: Int64
    world_size: Int64


class InitIn(BaseModel):
    init_info: NcclInitInfo


class UpdateInfo(BaseModel):
    """vLLM's NCCLWeightTransferUpdateInfo; `ipc_handles*` are its IPC backend's."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Int64]]
    packed: bool = False
    packed_buffer_size_bytes: Int64 = PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: Int64 = Field(default=2, ge=1)
    is_checkpoint_format: bool = True
    ipc_handles: Any = None
    ipc_handles_pickled: str | None = None


class UpdateIn(BaseModel):
    """vLLM's `{update_info}` or prime-rl's `{weight_dir, mode}`: exactly one."""

    model_config = ConfigDict(extra="forbid")
    update_info: UpdateInfo | None = None
    weight_dir: str | None = None
    mode: str = "full"  # prime-rl's; "delta" (its sparse updates) is not taken


class PrimeBroadcasterIn(BaseModel):
    """prime-rl's `/init_broadcaster` body (AdminPlane.initialize_nccl)."""

    model_config = ConfigDict(extra="forbid")
    host: str
    port: Int64
    rank_offset: Int64 = 0
    inference_world_size: Int64
    timeout: float = Field(default=1200.0, gt=0)
    quantize_in_weight_transfer: bool = False
    engine_world_size: Int64 | None = None


class StartIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    is_checkpoint_format: bool = True


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


async def _answer(request: Request, call: calls.Call) -> dict[str, Any]:
    return msgspec.to_builtins(await _client(request).call(call))


def _group_timeouts(request: Request) -> dict[str, float]:
    """Groups joined here whose updates arrive through `/update_weights {weight_dir}`, with
    their timeouts; `/destroy_weights_update_group` takes a group out."""
    if not hasattr(request.app.state, "group_timeouts"):
        request.app.state.group_timeouts = {}
    return request.app.state.group_timeouts


def _backend(client: AsyncEngineClient) -> str:
    """vLLM's own wire on a GPU; gloo (torch.distributed's layout) on a CPU, which has no NCCL."""
    return "vllm_nccl" if str(client.info.get("device", "cpu")).startswith("cuda") else "gloo"


async def _join(request: Request, group_name: str, **join: Any) -> dict[str, Any]:
    """Join `group_name`, replacing a group of that name (a trainer that restarts)."""
    client = _client(request)
    try:
        await client.call(calls.DestroyWeightsUpdateGroup(group_name=group_name))
    except InvalidRequest:
        pass  # none yet
    return await _answer(request, calls.InitWeightsUpdateGroup(group_name=group_name, backend=_backend(client), **join))


@router.post("/init_weight_transfer_engine", include_in_schema=False)
async def init_weight_transfer_engine(body: InitIn, request: Request) -> dict[str, Any]:
    """Blocks until the trainer has joined (its `trainer_init` runs beside this request)."""
    info = body.init_info
    joined = await _join(request, VLLM_GROUP, master_address=info.master_address, master_port=info.master_port,
                         rank_offset=info.rank_offset, world_size=info.world_size)
    return {"message": "Weight transfer initialized"} | joined


@router.post("/update_weights")
async def update_weights(body: UpdateIn, request: Request) -> dict[str, Any]:
    if (body.update_info is None) == (body.weight_dir is None):
        raise InvalidRequest("give exactly one of update_info (vLLM's weight transfer) and weight_dir (a checkpoint directory)")
    if body.mode != "full":
        raise InvalidRequest(f"mode {body.mode!r} is not supported: only 'full' (every weight, in checkpoint format)")
    if body.weight_dir is not None:
        if PRIME_GROUP in _group_timeouts(request):
            return await _receive_prime_chunks(request, Path(body.weight_dir), _group_timeouts(request)[PRIME_GROUP])
        return {"message": "Weights updated"} | await _answer(request, calls.UpdateWeightsFromDisk(model_path=body.weight_dir))
    info = body.update_info
    if info.ipc_handles is not None:
        raise InvalidRequest("update_info.ipc_handles travels over Ray only; over HTTP send ipc_handles_pickled")
    if info.ipc_handles_pickled is not None:
        if len(info.dtype_names) != len(info.names) or len(info.shapes) != len(info.names):
            raise InvalidRequest("update_info: names, dtype_names and shapes must have one entry per tensor")
        from engine.weights.payload import vllm_ipc_payload  # torch: imported when used

        try:
            payload = vllm_ipc_payload(info.names, info.ipc_handles_pickled)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        update = calls.UpdateWeightsFromTensor(serialized_named_tensors=[payload], load_format="vllm_ipc")
        return {"message": "Weights updated"} | await _answer(request, update)
    if info.packed and info.packed_buffer_size_bytes != PACKED_BUFFER_SIZE_BYTES:
        raise InvalidRequest(f"packed_buffer_size_bytes must be vLLM's default {PACKED_BUFFER_SIZE_BYTES}, "
                             f"got {info.packed_buffer_size_bytes}")
    update = calls.UpdateWeightsFromDistributed(
        names=info.names, dtypes=info.dtype_names, shapes=info.shapes, group_name=VLLM_GROUP,
        load_format="packed" if info.packed else None,
    )
    return {"message": "Weights updated"} | await _answer(request, update)


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict[str, str]:
    await _parse(request, StartIn)
    return {"message": "Weight update started"}


@router.post("/finish_weight_update")
async def finish_weight_update() -> dict[str, str]:
    return {"message": "Weight update finished"}


@router.post("/init_broadcaster")
async def init_broadcaster(body: PrimeBroadcasterIn, request: Request) -> dict[str, Any]:
    """prime-rl's NCCL broadcaster; blocks until its trainer has joined."""
    if body.quantize_in_weight_transfer:
        raise InvalidRequest("quantize_in_weight_transfer is not supported: weights arrive in their checkpoint dtype")
    joined = await _join(request, PRIME_GROUP, master_address=body.host, master_port=body.port,
                         rank_offset=body.rank_offset + 1, world_size=body.inference_world_size + 1,
                         timeout_s=body.timeout)
    _group_timeouts(request)[PRIME_GROUP] = body.timeout
    return {"message": "Broadcaster initialized"} | joined


async def _receive_prime_chunks(request: Request, weight_dir: Path, timeout_s: float) -> dict[str, Any]:
    """prime-rl's NCCL update: the chunk count, then each chunk's metadata and its broadcasts."""
    deadline = time.monotonic() + timeout_s
    manifest = await _wait_json(weight_dir / PRIME_MANIFEST, deadline)
    chunks = manifest.get("num_chunks") if isinstance(manifest, dict) else None
    if not isinstance(chunks, int) or chunks < 1:
        raise InvalidRequest(f"{weight_dir / PRIME_MANIFEST}: num_chunks must be a positive int, got {chunks!r}")
    answer: dict[str, Any] = {}
    for i in range(chunks):
        chunk = await _wait_json(weight_dir / PRIME_CHUNK.format(i), deadline)
        try:
            update = calls.UpdateWeightsFromDistributed(
                names=chunk["names"], dtypes=chunk["dtype_names"], shapes=chunk["shapes"], group_name=PRIME_GROUP)
        except (KeyError, TypeError) as e:
            raise InvalidRequest(f"{weight_dir / PRIME_CHUNK.format(i)}: needs names, dtype_names and shapes: {e}") from None
        answer = await _answer(request, update)
    return {"message": "Weights updated", "chunks": chunks} | answer


async def _wait_json(path: Path, deadline: float) -> Any:
    """The JSON in `path` once it exists (prime-rl writes it whole, by a rename)."""
    while not path.exists():
        if time.monotonic() > deadline:
            raise InvalidRequest(f"{path} did not appear within the broadcaster's timeout")
        await asyncio.sleep(MANIFEST_POLL_S)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InvalidRequest(f"{path}: not JSON: {e}") from None


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    try:
        return model.model_validate(json.loads(raw)) if raw.strip() else model()
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"invalid request body: {e}") from None
