"""How many KV blocks a rank's cache gets (startup step 2 of `ModelRunner`): a fixed count when the
config names one; on CUDA, what the device has left after one profiling forward at the largest
token budget (engine/memory/kv_budget.py's pure rules over a `GpuMemoryProfile`); on a CPU,
`kv_cache_memory_gb`. Never more blocks than `max_num_seqs` requests of full context could use,
and the same count on every tensor-parallel rank (the fewest any has room for).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from engine.attention import AttentionBackend, ForwardContext
from engine.config import EngineConfig, ModelConfig
from engine.memory.kv_budget import (
    GpuMemoryProfile,
    gpu_kv_budget,
    kv_block_bytes,
    num_kv_blocks_for_budget,
)
from engine.parallel import TensorParallel
from engine.runner.draft_model import DraftModel
from engine.runner.graph_sizes import GraphSizes
from engine.runner.step_inputs import Uploader, build_metadata

log = logging.getLogger("siesta.engine")

_GIB = 1 << 30
# Device memory kept back for what comes after the KV cache besides the graphs' static logits
# (the graphs' pool, cuBLAS workspaces of new shapes), bytes.
_GRAPH_MARGIN = 256 << 20


class SizedRunner(Protocol):
    """What the sizing reads of the model runner (model_runner.py), its model and weights loaded."""

    config: EngineConfig
    model_config: ModelConfig
    model: nn.Module
    device: torch.device
    dtype: torch.dtype
    tp: TensorParallel
    upload: Uploader
    block_size: int
    num_heads: int
    num_kv_heads: int
    max_model_len: int
    graph_sizes: GraphSizes
    draft: DraftModel | None

    def make_backend(self, kv_cache: torch.Tensor) -> AttentionBackend: ...


def num_kv_blocks(runner: SizedRunner) -> int:
    """The KV blocks of `runner`'s cache, its model and weights loaded, nothing else allocated yet."""
    config = runner.config
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = kv_block_bytes(runner.model_config, runner.block_size, runner.dtype, runner.num_kv_heads)
    if runner.draft is not None:  # its cache has the same blocks (engine/runner/draft_model.py)
        block_bytes += runner.draft.block_bytes(runner.dtype)
    max_useful = config.max_num_seqs * -(-runner.max_model_len // runner.block_size)
    if runner.device.type == "cuda":
        profile = _profile(runner)
        budget = gpu_kv_budget(profile, config.mem_fraction)
        log.info(
            "memory profile: device %.1f GiB, outside torch %.2f GiB, peak forward %.2f GiB, reserve %.2f GiB"
            " -> KV budget %.2f GiB at mem_fraction %.2f",
            profile.total_bytes / _GIB, profile.non_torch_bytes / _GIB, profile.peak_torch_bytes / _GIB,
            profile.reserve_bytes / _GIB, budget / _GIB, config.mem_fraction,
        )
    else:
        budget = int(config.kv_cache_memory_gb * _GIB)
    blocks = num_kv_blocks_for_budget(budget, block_bytes, max_useful)
    return runner.tp.min_over_ranks(blocks, runner.device)


@torch.inference_mode()
def _profile(runner: SizedRunner) -> GpuMemoryProfile:
    """One forward at the largest token budget over a scratch KV cache just big enough for it;
    torch's peak allocation, less that scratch cache, is what a step may need besides KV. The
    reserve: the decode graphs' static logits (the draft model's too) and the piecewise graphs'
    pool (at most that peak less what was resident before it, the weights above all, plus their
    largest size's buffers), each with a margin."""
    config, mc, device, block_size = runner.config, runner.model_config, runner.device, runner.block_size
    max_len = runner.max_model_len
    budget = min(config.max_num_batched_tokens, config.max_num_seqs * max_len)
    lens = [max_len] * (budget // max_len) + ([budget % max_len] if budget % max_len else [])
    blocks = [-(-n // block_size) for n in lens]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)  # the weights and what startup allocated so far
    scratch = torch.empty(
        (mc.num_layers, 2, sum(blocks), block_size, runner.num_kv_heads, mc.head_dim), dtype=runner.dtype, device=device
    )
    scratch_bytes = scratch.numel() * scratch.element_size()
    tables, first = [], 0
    for b in blocks:
        tables.append(list(range(first, first + b)))
        first += b
    meta = build_metadata(lens, [0] * len(lens), tables, block_size, runner.upload)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    ids = torch.zeros(budget, dtype=torch.int64, device=device)
    hidden = runner.model(ids, positions, ForwardContext(runner.make_backend(scratch), meta))
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=device)
    runner.model.compute_logits(hidden[last])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del scratch, hidden, meta
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)
    itemsize = torch.finfo(runner.dtype).bits // 8
    graph_max_bs = runner.graph_sizes.decode_max_bs
    reserve = graph_max_bs * mc.vocab_size * itemsize + _GRAPH_MARGIN if graph_max_bs else 0
    reserve += runner.graph_sizes.draft_rows * mc.vocab_size * itemsize  # the draft's graphs' logits (same vocabulary)
    pieces = runner.graph_sizes.piecewise(budget)
    if pieces:  # the piecewise graphs' pool holds a forward's activations, not the weights again
        reserve += peak - resident + pieces[-1] * (runner.num_heads * mc.head_dim + mc.hidden_size) * itemsize + _GRAPH_MARGIN
    return GpuMemoryProfile(total, max(non_torch, 0), peak, reserve)
