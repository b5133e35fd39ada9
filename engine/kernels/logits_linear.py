"""A decode graph's logits (1-64 rows, engine/runner/cuda_graph.py) with the greedy sampler's
pieces: a persistent Triton matmul over the vocabulary whose epilogue folds each column tile into
one running (max, sum of exp, first argmax) per row and program, so the sampler reads no logits
and merges few pieces (engine/kernels/lse_argmax.py `merge_pieces`). Only the CUDA path of
`LlamaForCausalLM.compute_logits` and lse_argmax.py (for `piece`) import this module (it imports
Triton).

    y [M, V] = x [M, K] @ weight [V, K].T;   per row and program: max, sum of exp(x - max), first argmax

Why persistent: with one program a column tile (skinny_linear's tiles, as bench/history/2026-11-28.md
had it) each tile's epilogue ran after its own loads and before the next program's, and a row had
one piece a tile (2374 at 64 rows) for the sampler to merge. Here PROGRAMS_PER_SM programs an SM
take tiles i, i + P, ... in one software pipeline (the tile loop and K loop flattened,
`tl.range(flatten=True)`): the next tile's weights stream during a tile's epilogue, and a row has
P pieces. H200, Qwen3-0.6B's lm_head (the lm_head probe of bench/history/2026-11-28.md), logits and
merge: 64 rows 96.2 -> 85.0 us, 16 rows ~81.6 -> 79.4, one row ~77 -> 75.0.

Rules:
- Tiles BLOCK_N columns x all K; P = min(PROGRAMS_PER_SM x SMs, tiles) programs, one wave.
- A program's tiles come in increasing column order, so its running argmax keeps the earlier
  column on a tie; across programs the merge takes the least column holding the row's maximum.
- Roundings: the logits are rounded to the model dtype once (as skinny_linear and cuBLAS do), and
  the pieces are of x = that logit / t (IEEE division), skipped when every row has t = 1 (x / 1
  is x). The running sum is rescaled to each new max, so lse matches lse_argmax's to fp32
  rounding, not bit for bit.
- On Hopper it launches with PDL: the first lines of its first tile go to L2 before it waits
  (engine/kernels/pdl.py). Grid and pieces are fixed by the shapes and the device: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.launcher import Launcher
from engine.kernels.skinny_linear import num_sms

# Tiles (block_n, block_k), warps, pipeline stages and programs per SM: the probe's best at 1, 16,
# 32 and 64 rows of the 0.6B lm_head (64 x 64 x 4 x 4, 3 an SM: 40-104 KB of shared memory each).
# A K that 64 does not divide takes K steps of 32 or 16 (tiny test models).
CONFIG = dict(block_n=64, block_k=64, num_warps=4, num_stages=4)
PROGRAMS_PER_SM = 3
MAX_ROWS = 64
_PREFETCH_LINES = 2  # 128-byte lines of each first-tile weight row pulled into L2 before the PDL wait


def block_k(k: int, want: int = CONFIG["block_k"]) -> int:
    """The K step for a weight of K columns: `want`, else the largest of 32, 16 dividing k (0: none)."""
    return next((b for b in (want, 32, 16) if k % b == 0), 0)


def pieces(vocab: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM, block_n: int = CONFIG["block_n"]) -> int:
    """Pieces a row the logits of a [V = vocab, K] weight on `device` write: one a program."""
    return min(per_sm * num_sms(device.index or 0), triton.cdiv(vocab, block_n))


@triton.jit
def piece(x, AXIS: tl.constexpr):
    # The sampler's piece of x / t values (-inf: masked or banned) along AXIS: (max, sum of
    # exp(x - max), first index of the max); a piece of all -inf is (-inf, 0, 0). The logits'
    # epilogue below and engine/kernels/lse_argmax.py's per-chunk pieces, which its _merge_row merges.
    mx, arg = tl.max(x, AXIS, return_indices=True, return_indices_tie_break_left=True)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(tl.exp(x - tl.expand_dims(shift, AXIS)), AXIS), arg


@Launcher
@triton.jit(do_not_specialize=["M"])
def _logits_kernel(
    x_ptr,  # [M, K], unit last stride
    w_ptr,  # [N, K], contiguous
    out_ptr,  # [M, N], unit last stride
    t_ptr,  # [M] float32 temperatures
    max_ptr, sum_ptr, arg_ptr,  # [M, P] float32, float32, int64: the rows' pieces, one a program
    M, N, stride_xm, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    if USE_PDL:  # engine/kernels/pdl.py: the weights are no kernel's output
        if PREFETCH_LINES > 0:
            first = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)[:, None] * K
            pdl.prefetch_l2(w_ptr + first + (tl.arange(0, PREFETCH_LINES) * LINE)[None, :])
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.load(t_ptr + offs_m, mask=m_ok, other=1.0)
    greedy = tl.max(tl.abs(t - 1.0), 0) == 0.0
    dtype = out_ptr.dtype.element_ty
    run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_M], tl.float32)
    run_arg = tl.zeros([BLOCK_M], tl.int64)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    for tile in tl.range(pid, tl.cdiv(N, BLOCK_N), programs, flatten=True):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k0)), acc)
        logits = acc.to(dtype)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], logits, mask=m_ok[:, None] & n_ok[None, :])
        x = logits.to(tl.float32)
        if not greedy:
            x = tl.math.div_rn(x, t[:, None])
        mx, total, arg = piece(tl.where(n_ok[None, :], x, float("-inf")), 1)  # [BLOCK_M] each
        top = tl.maximum(run_max, mx)
        shift = tl.where(top == float("-inf"), 0.0, top)
        run_sum = run_sum * tl.exp(run_max - shift) + total * tl.exp(mx - shift)
        run_arg = tl.where(mx > run_max, (tile * BLOCK_N + arg).to(tl.int64), run_arg)  # a tie keeps the earlier column
        run_max = top
    out = offs_m * programs + pid
    tl.store(max_ptr + out, run_max, mask=m_ok)
    tl.store(sum_ptr + out, run_sum, mask=m_ok)
    tl.store(arg_ptr + out, run_arg, mask=m_ok)


def logits_linear(
    x: torch.Tensor,  # [M, K] bf16/fp16 CUDA, 1 <= M <= MAX_ROWS, unit last stride
    weight: torch.Tensor,  # [V, K] contiguous, x's dtype
    out: torch.Tensor,  # [M, V], unit last stride: the logits, written in place (a graph's buffer)
    # the rows' temperatures [M] float32, then [M, pieces(V)] maxima, sums (float32), argmaxes (int64)
    lse: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    config: dict[str, int] | None = None,  # tuning overrides (bench/history/2026-11-28.md, the lm_head probe): CONFIG's keys
    per_sm: int = PROGRAMS_PER_SM,
) -> torch.Tensor:  # out
    m, k = x.shape
    n = weight.shape[0]
    cfg = {**CONFIG, **(config or {})}
    temps, maxima, sums, args = lse
    count = pieces(n, x.device, per_sm, cfg["block_n"])
    ok = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and 0 < m <= MAX_ROWS and x.stride(-1) == 1
    ok = ok and weight.is_contiguous() and weight.dtype == x.dtype and weight.shape[1] == k and block_k(k, cfg["block_k"]) > 0
    ok = ok and out.shape == (m, n) and out.dtype == x.dtype and out.stride(-1) == 1
    ok = ok and temps.shape == (m,) and temps.dtype == torch.float32 and all(t.is_contiguous() for t in lse[1:])
    ok = ok and maxima.shape == sums.shape == args.shape == (m, count) and maxima.dtype == sums.dtype == torch.float32
    if not ok or args.dtype != torch.int64:
        raise ValueError(
            f"logits_linear: x [{m}, {k}] {x.dtype} (1-{MAX_ROWS} rows, K a multiple of 16), weight "
            f"{tuple(weight.shape)} {weight.dtype}, out {tuple(out.shape)}, and float32 temperatures [{m}] and contiguous "
            f"[{m}, {count}] pieces (float32, float32, int64), got {[(tuple(t.shape), t.dtype) for t in lse]}"
        )  # fmt: skip
    use_pdl = pdl.enabled(x.device)
    _logits_kernel[(count,)](
        x, weight, out, temps, maxima, sums, args, m, n, x.stride(0), out.stride(0),
        K=k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=cfg["block_n"], BLOCK_K=block_k(k, cfg["block_k"]),
        USE_PDL=use_pdl, PREFETCH_LINES=_PREFETCH_LINES if use_pdl else 0, LINE=128 // x.element_size(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=use_pdl,
    )  # fmt: skip
    return out
