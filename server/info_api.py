"""Server information routes as SGLang names them, which RL clients and routers read:
`/server_info` (`/get_server_info`), `/get_weight_version` (`/weight_version`) and `/v1/loads`.

Rules:
- `/server_info` carries our own keys (engine info, KV blocks, queue lengths, `server_args`,
  `engine_pid`, `api_server`: which API server process answered, of how many, its pid) and the keys of SGLang's that clients read or assert: parallel sizes (all 1: one
  engine on one device), `enable_memory_saver` (true only when memory regions are really on),
  `disaggregation_mode` "null", `encoder_only` false, `max_total_num_tokens` (KV blocks times
  the block size), `max_running_requests`, `max_req_input_len`, `status` "ready", `version`,
  `weight_version`, and `internal_states` with `memory_usage` (GB) and `last_gen_throughput`.
- `/v1/loads`: SGLang's shape, one rank (`dp_rank` 0); `include` is a comma-separated list of
  core, memory, spec, lora, disagg, queues, all (default all). The core fields always come;
  memory and queues are reported; spec, lora and disagg have nothing here and are left out (as
  SGLang leaves out sections it has no data for). Any other section is a 400. `format=prometheus`
  gives the same numbers as Prometheus gauges.
"""

from __future__ import annotations

import importlib.metadata
import os
from datetime import datetime, timezone
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.client.async_client import AsyncEngineClient
from engine.core import calls
from engine.errors import InvalidRequest

router = APIRouter()

GB = 1e9
SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
REPORTED_SECTIONS = ("memory", "queues")


def version() -> str:
    try:
        return importlib.metadata.version("siesta-serve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    client = _client(request)
    info = await client.call(calls.GetInfo())
    load = await client.call(calls.GetLoad())
    cfg = info["config"]
    capacity = info["kv_blocks_total"] * info["block_size"]
    server = request.app.state.server_config
    sglang = {
        "tokenizer_path": cfg["tokenizer"] or info["model_path"],
        "served_model_name": request.app.state.model_name,
        "host": server.host, "port": server.port,
        "tp_size": info["tp_size"], "pp_size": 1, "dp_size": 1, "ep_size": info["ep_size"], "moe_dp_size": 1, "nnodes": 1,
        "num_gpus": info["tp_size"] if info["device"].startswith("cuda") else 0,
        "disaggregation_mode": "null",
        "encoder_only": False,
        "is_embedding": False,
        "skip_tokenizer_init": False,
        "enable_memory_saver": bool(info["memory_saver"]),
        "enable_return_routed_experts": bool(cfg["enable_return_routed_experts"]),
        "context_length": info["max_context_length"],
        "page_size": info["block_size"],
        "random_seed": cfg["seed"],
        "chunked_prefill_size": cfg["max_num_batched_tokens"],
        "mem_fraction_static": cfg["mem_fraction"],
        "disable_radix_cache": not cfg["enable_prefix_caching"],
        "disable_cuda_graph": cfg["disable_cuda_graph"],
        "disable_overlap_schedule": cfg["disable_overlap_schedule"],
        "max_total_num_tokens": capacity,
        "max_running_requests": cfg["max_num_seqs"],
        "max_req_input_len": max(min(info["max_context_length"], capacity) - 1, 1),
        "status": "ready",
        "version": version(),
        "internal_states": [{
            "memory_usage": {
                "weight": round(info["weights_bytes"] / GB, 3),
                "kvcache": round(info["kv_cache_bytes"] / GB, 3),
                "token_capacity": capacity,
                "graph": round(info["cuda_graph_bytes"] / GB, 3),
            },
            "last_gen_throughput": load["gen_throughput"],
            "effective_max_running_requests_per_dp": cfg["max_num_seqs"],
        }],
    }
    state = msgspec.to_builtins(client.state)  # as of the GetInfo reply just received
    api_server = {"index": request.app.state.api_server_index, "count": server.api_server_count, "pid": os.getpid()}
    return info | sglang | {"server_args": server.public(), "engine_pid": client.pid, "engine_state": state,
                            "api_server": api_server}


@router.get("/get_weight_version")
@router.get("/weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    info = await _client(request).call(calls.GetInfo())
    return {"weight_version": info["weight_version"]}


@router.get("/v1/loads")
async def loads(request: Request, include: str | None = None, dp_rank: int | None = None,
                format: str | None = None) -> Any:
    """SGLang's /v1/loads: `{"timestamp", "version", "loads": [per-rank load]}`."""
    sections = {s.strip() for s in include.split(",") if s.strip()} if include else {"all"}
    unknown = sections - SECTIONS
    if unknown:
        raise InvalidRequest(f"invalid include sections {sorted(unknown)}; valid: {sorted(SECTIONS)}")
    if format not in (None, "json", "prometheus"):
        raise InvalidRequest(f"unknown format {format!r}; use json or prometheus")
    load = await _client(request).call(calls.GetLoad())
    for name in REPORTED_SECTIONS:
        if name not in sections and "all" not in sections:
            del load[name]
    loads_ = [load] if dp_rank in (None, 0) else []
    if format == "prometheus":
        return Response(_prometheus(loads_), media_type="text/plain; version=0.0.4; charset=utf-8")
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": version(), "loads": loads_}


def _prometheus(loads: list[dict[str, Any]]) -> str:
    """Gauges named as SGLang's: sglang_<field> and sglang_<section>_<field>, by dp_rank."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    samples.setdefault(f"sglang_{key}_{sub}", []).append((rank, v))
            elif key != "dp_rank":
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {v}' for rank, v in values]
    return "\n".join(lines) + "\n"
