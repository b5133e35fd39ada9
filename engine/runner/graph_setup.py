"""Startup step 4 of `ModelRunner` (model_runner.py), inside the `cuda_graph` region: the attention
backends (the target's over its cache, the draft model's over its own), the persistent decode
paths attached to the layers (engine/decode/attach.py, CUDA only), and the captured graphs: decode
graphs, piecewise graphs and the draft model's, on one shared pool (they never run at once), each
captured through the memory regions' hook (`MemoryRegions.graph_capture`). And which tensors that
region holds (`region_tensors`), for its release and its poisoned resumes.

Rules:
- The pool's bytes count once, at the largest any runner reported; every runner's static buffers
  count on top (`graph_bytes`).
- A view of the KV cache or of the weights is not the region's: their own regions hold them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention import AttentionBackend
from engine.config import EngineConfig, ModelConfig
from engine.decode.attach import attach_decode_paths, long_kv_rows
from engine.memory.poison import tensors_of
from engine.memory.regions import MemoryRegions
from engine.models.hooks import DecodeStepPath
from engine.runner.cuda_graph import CudaGraphRunner
from engine.runner.draft_model import DraftModel
from engine.runner.graph_sizes import GraphSizes
from engine.runner.piecewise_graph import PiecewiseGraphRunner


class GraphedRunner(Protocol):
    """What this step reads of the model runner (its model, weights and KV cache in place) and the
    fields it sets (attn_backend, decode_paths, graphs, piecewise, graph_bytes)."""

    config: EngineConfig
    model_config: ModelConfig
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    num_heads: int
    block_size: int
    num_kv_blocks: int
    kv_caches: list[torch.Tensor]  # the target's, then the draft model's
    graph_sizes: GraphSizes
    memory: MemoryRegions
    draft: DraftModel | None
    attn_backend: AttentionBackend
    decode_paths: list[DecodeStepPath]
    graphs: CudaGraphRunner | None
    piecewise: PiecewiseGraphRunner | None
    graph_bytes: int

    def make_backend(self, kv_cache: torch.Tensor, draft: ModelConfig | None = None) -> AttentionBackend: ...


def attach_graphs(runner: GraphedRunner) -> None:
    """Build the backends, decode paths and graph runners of `runner` and capture the graphs."""
    config, mc, draft = runner.config, runner.model_config, runner.draft
    runner.graphs, runner.piecewise, runner.decode_paths = None, None, []
    piecewise_sizes = runner.graph_sizes.piecewise(runner.num_kv_blocks * runner.block_size)
    graph_max_bs = runner.graph_sizes.decode_max_bs
    with runner.memory.region("cuda_graph"):
        runner.attn_backend = runner.make_backend(runner.kv_caches[0])
        if draft is not None:
            draft.backend = runner.make_backend(runner.kv_caches[1], draft.config)
        if runner.device.type == "cuda":  # in --deterministic only paths in its orders (attach.py)
            runner.decode_paths = attach_decode_paths(runner.model, runner.attn_backend, config)
            if draft is not None:
                draft.decode_paths = attach_decode_paths(draft.model, draft.backend, config)
        pool = torch.cuda.graph_pool_handle() if graph_max_bs > 0 or piecewise_sizes else None
        if graph_max_bs > 0:
            runner.graphs = CudaGraphRunner(
                runner.model, runner.attn_backend, graph_max_bs, mc.vocab_size, runner.device, pool=pool,
                long_kv_rows=long_kv_rows(runner.decode_paths), verify_rows=runner.graph_sizes.verify_rows,
            )  # fmt: skip
        if piecewise_sizes:
            runner.piecewise = PiecewiseGraphRunner(
                runner.model, runner.attn_backend, piecewise_sizes, mc.hidden_size, runner.num_heads, mc.head_dim,
                runner.dtype, runner.device, pool=pool,
            )  # fmt: skip
        if draft is not None and runner.graph_sizes.draft_rows:  # the draft's forwards (draft_model.py)
            draft.make_graphs(runner.graph_sizes.draft_rows, runner.graph_sizes.verify_rows > 0, runner.device, pool,
                              long_kv_rows(draft.decode_paths))  # fmt: skip
    runner.graph_bytes = 0
    runners = (runner.graphs, runner.piecewise, draft.graphs if draft is not None else None)
    for r in runners:
        if r is not None:
            r.capture(runner.memory.graph_capture)
            runner.graph_bytes += r.static_bytes
    pool_bytes = max((r.pool_bytes for r in runners if r is not None), default=0)
    runner.memory.bytes["cuda_graph"] += pool_bytes
    runner.graph_bytes += pool_bytes


def region_tensors(runner: GraphedRunner, others: list[object], weights: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the `cuda_graph` region holds: the attention backends' workspaces and graph
    buffers, the graphs' static inputs and outputs, the persistent decode paths' buffers, and
    `others` (the MoE workspaces, the invariant matmuls' arrivals, the routed experts' record);
    not views of the KV caches or of the weights' one allocation `weights`."""
    draft = runner.draft
    owners = [runner.attn_backend, runner.graphs, runner.graphs.io if runner.graphs else None, runner.piecewise,
              *runner.decode_paths, *others,
              *((draft.backend, draft.graphs, draft.graphs and draft.graphs.io, *draft.decode_paths) if draft is not None else ())]  # fmt: skip
    kept = {t.untyped_storage().data_ptr() for t in (*runner.kv_caches, weights)}
    return [t for o in owners if o is not None for t in tensors_of(o) if t.untyped_storage().data_ptr() not in kept]
