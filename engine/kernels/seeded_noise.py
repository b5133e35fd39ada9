"""The sampler's Exp(1) noise of its seeded rows (engine/runner/sampler.py, the exponential race
argmax(probs / q)) in one launch: row rows[i] of noise [B, V] float32 becomes -log(1 - u), u
uniform in [0, 1) from Philox keyed by seeds[i] (the row's step seed,
engine/runner/sampling_plan.py `step_seed`) and the column: a Philox call gives four uniforms
(tl.rand4x), the columns j, j + BLOCK/4, j + BLOCK/2, j + 3 BLOCK/4 of a BLOCK (a quarter of
tl.rand's calls: 148.8 -> 75.7 us a step of 256 rows at a 152k vocabulary, H200). One program per
(seeded row, BLOCK columns).

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
    QUARTER: tl.constexpr = BLOCK // 4
    quads = tl.program_id(1) * QUARTER + tl.arange(0, QUARTER)  # the Philox counters of this block
    first = tl.program_id(1) * BLOCK + tl.arange(0, QUARTER)  # the columns of u0
    row_ptr = noise_ptr + tl.load(rows_ptr + i) * stride
    u0, u1, u2, u3 = tl.rand4x(tl.load(seeds_ptr + i), quads)  # [QUARTER] each, in [0, 1)
    tl.store(row_ptr + first, -tl.log(1.0 - u0), mask=first < vocab)
    tl.store(row_ptr + first + QUARTER, -tl.log(1.0 - u1), mask=first + QUARTER < vocab)
    tl.store(row_ptr + first + 2 * QUARTER, -tl.log(1.0 - u2), mask=first + 2 * QUARTER < vocab)
    tl.store(row_ptr + first + 3 * QUARTER, -tl.log(1.0 - u3), mask=first + 3 * QUARTER < vocab)


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
