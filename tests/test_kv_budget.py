"""KV cache sizing and the CUDA-graph ladder: pure arithmetic, checked on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError, ModelConfig
from engine.memory.kv_budget import (
    GpuMemoryProfile,
    gpu_kv_budget,
    kv_block_bytes,
    num_kv_blocks_for_budget,
)
from engine.runner.cuda_graph import graph_batch_sizes

GIB = 1 << 30


def test_block_bytes_count_k_and_v_of_every_layer(qwen3_dir: str) -> None:
    mc = ModelConfig.from_hf(qwen3_dir)
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim
    assert kv_block_bytes(mc, 16, torch.bfloat16) == 16 * per_token * 2
    assert kv_block_bytes(mc, 32, torch.float32) == 32 * per_token * 4


def test_blocks_for_budget_are_capped_and_refused_when_none_fit() -> None:
    assert num_kv_blocks_for_budget(10 * 1000, 1000, max_useful_blocks=100) == 10
    assert num_kv_blocks_for_budget(10 * 1000 + 999, 1000, max_useful_blocks=100) == 10
    assert num_kv_blocks_for_budget(GIB, 1000, max_useful_blocks=100) == 100
    with pytest.raises(ConfigError, match="holds no block"):
        num_kv_blocks_for_budget(999, 1000, max_useful_blocks=100)
    with pytest.raises(ConfigError, match="holds no block"):
        num_kv_blocks_for_budget(-5 * GIB, 1000, max_useful_blocks=100)


def test_gpu_budget_is_the_share_less_everything_else() -> None:
    profile = GpuMemoryProfile(total_bytes=80 * GIB, non_torch_bytes=GIB // 2, peak_torch_bytes=3 * GIB, reserve_bytes=GIB // 4)
    assert gpu_kv_budget(profile, 0.9) == int(72 * GIB) - GIB // 2 - 3 * GIB - GIB // 4
    assert gpu_kv_budget(profile, 0.5) == 40 * GIB - GIB // 2 - 3 * GIB - GIB // 4
    # A share smaller than what the engine already holds leaves a negative budget, refused above.
    assert gpu_kv_budget(profile, 0.04) < 0


@pytest.mark.parametrize(
    "max_bs,ladder",
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (12, [1, 2, 4, 8, 12]),
        (32, [1, 2, 4, 8, 16, 24, 32]),
        (256, [1, 2, 4, *range(8, 257, 8)]),
    ],
)
def test_graph_ladder(max_bs: int, ladder: list[int]) -> None:
    assert graph_batch_sizes(max_bs) == ladder
