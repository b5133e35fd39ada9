"""The fused MoE's tile choices (fused_moe.py): each grouped GEMM's (block_m, block_n, block_k,
warps, stages) by the expected pairs per expert, and whether a call skips the sort (one tile a
pair), which engine/models/moe.py also asks to pick the one-launch router (moe_router.py).

Rules:
- Configs by expected pairs per expert, T * k / E (vLLM's H200 table for E=128, I=768, with
  gate_up's BLOCK_N halved: one program holds a gate and an up accumulator). gate_up and down
  share block_m: one sort serves both.
- Every config walks K in ascending BLOCK_K steps, so a token's bits do not follow the config
  (fused_moe.py's rules).
- fp32 models (tests) take small tiles: twice the bytes a value and no tensor cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton import next_power_of_2

from engine.kernels.moe_workspace import PAIR_TILE_PAIRS


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles (block_m, gate_up block_n, down block_n, block_k, warps, stages) by expected pairs per
# expert, T * k / E: SPARSE_TILES up to 2 (decode), then TILES' rows up to their first value. gate_up's
# tile holds a gate and an up accumulator: half down's columns (at T = 1, 64 of each, the kernel
# bench's best, made the 30B-A3B step slower: bench/history/2026-12-01.md, entry f; so did 16 / 32,
# entry l).
SPARSE_TILES = (16, 32, 64, 128, 4, 4)
TILES = ((8, (16, 64, 128, 128, 4, 3)), (16, (32, 64, 128, 128, 4, 3)), (48, (64, 64, 128, 64, 4, 3)),
         (1 << 62, (128, 128, 256, 64, 8, 4)))  # fmt: skip


def gemm_configs(tokens: int, num_experts: int, top_k: int, n_up: int, n_down: int, k_up: int, k_down: int,
                 dtype: torch.dtype) -> tuple[GemmConfig, GemmConfig]:  # fmt: skip
    """(gate_up, down) configs for T tokens; n_up = I (outputs after SiLU-and-mul), k_up = H,
    n_down = H, k_down = I. Both share block_m (one sort serves both)."""
    rows = tokens * top_k / num_experts  # expected pairs per expert
    tiles = SPARSE_TILES if rows <= 2 else next(t for most, t in TILES if rows <= most)
    bm, up_bn, bn, bk, warps, stages = tiles
    if dtype == torch.float32:  # twice the bytes a value, no tensor cores: small tiles (tests, fp32 models)
        bm, up_bn, bn, bk, warps, stages = min(bm, 64), min(up_bn, 32), min(bn, 64), min(bk, 32), 4, 2

    def fit(block_n: int, n: int, k: int) -> GemmConfig:
        return GemmConfig(bm, max(16, min(block_n, next_power_of_2(n))), max(16, min(bk, next_power_of_2(k))), warps, stages)

    return fit(up_bn, n_up, k_up), fit(bn, n_down, k_down)


def pair_tiles_apply(pairs: int, num_experts: int) -> bool:
    """Whether a call skips the sort: one tile a pair, for at most PAIR_TILE_PAIRS pairs over at
    least 4x as many experts (few experts are read twice)."""
    return pairs <= PAIR_TILE_PAIRS and 4 * pairs <= num_experts
