"""The KV tensor and how many blocks it gets: from `--num-kv-blocks`, from a CPU budget in GiB, or on
a GPU from what a profiling forward at the largest token budget leaves of `--mem-fraction`.
Pure functions, so the arithmetic is tested without a GPU. Which request holds which block is
`kv_cache.BlockManager`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError, ModelConfig


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block across all layers: K and V, each [block_size, num_kv_heads, head_dim]
    (`num_kv_heads`: the heads this tensor-parallel rank holds; default all)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = model_config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * model_config.num_layers * block_size * heads * model_config.head_dim * elem


def make_kv_cache(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """The KV cache, zeroed: [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
    (`num_kv_heads`: this tensor-parallel rank's; default all)."""
    mc = model_config
    heads = mc.num_kv_heads if num_kv_heads is None else num_kv_heads
    shape = (mc.num_layers, 2, num_blocks, block_size, heads, mc.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def num_kv_blocks_for_budget(budget_bytes: int, block_bytes: int, max_useful_blocks: int) -> int:
    """Blocks that fit in `budget_bytes`, capped at what the engine could ever use."""
    if budget_bytes < block_bytes:
        raise ConfigError(
            f"the KV cache budget ({budget_bytes / (1 << 20):.1f} MiB) holds no block of "
            f"{block_bytes} bytes; raise --mem-fraction (GPU) or --kv-cache-memory-gb (CPU), or "
            "lower --max-num-batched-tokens"
        )
    return max(1, min(budget_bytes // block_bytes, max_useful_blocks))


@dataclass(frozen=True)
class GpuMemoryProfile:
    """Device memory seen around one profiling forward at the largest token budget."""

    total_bytes: int  # the device's memory
    non_torch_bytes: int  # used outside torch's allocator: CUDA context, cuBLAS, NCCL, ...
    peak_torch_bytes: int  # torch's peak allocation: weights plus the forward's activations
    reserve_bytes: int  # what is still to come after the KV cache: CUDA graphs, their buffers


def gpu_kv_budget(profile: GpuMemoryProfile, mem_fraction: float) -> int:
    """Bytes left for the KV cache: the engine's share of the device, less everything else it holds."""
    share = int(profile.total_bytes * mem_fraction)
    return share - profile.non_torch_bytes - profile.peak_torch_bytes - profile.reserve_bytes
