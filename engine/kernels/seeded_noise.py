"""The sampler's Exp(1) noise of its seeded rows (engine/runner/sampler.py, the exponential race
argmax(probs / q)) in one launch: row rows[i] of noise [B, V] float32 becomes -log(1 - u), u
uniform in [0, 1) from Philox keyed by seeds[i] (the row's step seed,
engine/runner/sampling_plan.py `step_seed`) and the column (tl.rand). One program per (seeded
row, BLOCK columns).

Rules: a row's noise is a function of its seed and the vocabulary size alone, never of the other
rows or their number (what `--deterministic` and seeded requests rely on); it is finite and >= 0
(the sampler holds it above 0). Rows not named are left as they are. torch's per-row generators,
which this replaces on CUDA, took a host round of manual_seed + exponential_ per row: 2.3 ms of
host and 0.8 ms of device time a step of 256 seeded rows at a 152k vocabulary (H200,
bench/history/2026-11-30.md). Only CUDA code paths import this module (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.launcher import Launcher

BLOCK = 2048  # columns per program


@Launcher
@triton.jit
def _noise_kernel(noise_ptr, rows_ptr, seeds_ptr, vocab, stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    seed = tl.load(seeds_ptr + i)
    u = tl.rand(seed, cols)  # [BLOCK] in [0, 1)
    tl.store(noise_ptr + row * stride + cols, -tl.log(1.0 - u), mask=cols < vocab)


def exponential_rows(noise: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor) -> None:
    """noise [B, V] float32 (rows contiguous), rows [S] int64 (distinct, < B), seeds [S] int64 ->
    noise[rows[i]] = Exp(1) draws keyed by seeds[i], in place."""
    if noise.dim() != 2 or noise.dtype != torch.float32 or noise.stride(1) != 1:
        raise ValueError(f"exponential_rows: [B, V] float32 noise with contiguous rows, got {tuple(noise.shape)} {noise.dtype}")
    if rows.shape != seeds.shape or rows.dim() != 1 or rows.dtype != torch.int64 or seeds.dtype != torch.int64:
        raise ValueError("exponential_rows: rows and seeds must be int64 [S] each")
    if rows.numel():
        _noise_kernel[(rows.numel(), triton.cdiv(noise.shape[1], BLOCK))](
            noise, rows, seeds, noise.shape[1], noise.stride(0), BLOCK=BLOCK, num_warps=4
        )
