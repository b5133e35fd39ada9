"""Fused mixture-of-experts on the GPU: grouped GEMMs over the (token, expert) pairs sorted by expert,
as vLLM's and SGLang's Triton fused_moe, our own kernels. Called by engine/models/moe.py (CUDA
forward: `topk_softmax` from moe_routing.py, then `fused_moe`); only CUDA code paths import it.

    sorted pairs   = moe_align(topk_ids)                               (moe_align.py)
    inter [P, I]   = silu(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)   for each pair p = t*k + j
    y [P, H]       = inter[p] @ w2[e].T
    out [T, H]     = sum over j = 0..k-1 of topk_weights[t, j] * y[t*k + j]

where e = topk_ids[t, j], P = T * k. Rules:
- Grouped GEMM: one program per (BLOCK_M tile of one expert's pairs, BLOCK_N columns), over all
  of K in BLOCK_K steps, fp32 accumulation (bf16/fp16 on tensor cores; fp32 inputs in IEEE
  fp32, no tf32). Its grid is max_blocks(P) x columns: a step touches only the experts its
  tokens route to, and a few-token step's grid does not grow with E (programs past the padded
  count return at once).
- Few pairs (decode, `pair_tiles_apply`: P <= 32 and E >= 4P, e.g. T <= 4 at top-8 of 128): no
  sort at all; tile m is pair m alone, its expert read from topk_ids. Two launches a layer: the
  down GEMM's program that finishes a token's k pairs of a column tile last (split_kv's
  `last_to_arrive` on the workspace's `sum_counts`) sums them as the kernel below does. Both
  launch with PDL (engine/kernels/pdl.py) and wait first; the down GEMM then triggers, so the next
  layer's norm and qkv GEMV (which prefetches its weight) are placed while it streams. gate_up
  does not: the down GEMM's programs waiting beside it slowed the step (30B-A3B, batch 1;
  bench/history/2026-12-01.md, entry f).
- gate_up's epilogue applies SiLU-and-mul with the rounding of the unfused ops (gate and up
  rounded to the model dtype; silu in fp32 with libdevice's expf and an IEEE division, rounded;
  times up, rounded: skinny_linear.py's `_silu_mul`); [P, 2I] is never written.
- No atomic sums: y is written per pair and a second kernel (or, for few pairs, the last program
  of the down GEMM to arrive) sums a token's k rows in slot order in fp32 with the fp32 routing
  weights, rounding once. The bits of a token's output depend on its
  own x, ids and weights only, not on the other tokens of the batch, as long as the tiles'
  fp32 sums over K run in the same order (every config walks K in ascending BLOCK_K steps).
- Configs by expected pairs per expert, T * k / E (moe_tiles.py).
- Buffers come from a `MoeWorkspace` (moe_workspace.py), the shared one by default: no
  allocation when `out` is given, grids fixed by T: CUDA-graph capturable.
- Expert parallelism (`first`): w13 / w2 hold this rank's E experts, the model's experts
  first .. first + E - 1, and topk_ids are the model's ids. Another rank's pairs sort into one
  more bucket (moe_align.py) or, one tile a pair, map to it as their tile reads its id. Their
  tiles skip the K loop and write zeros, so they add nothing to the weighted sum. No extra
  launch. Without `first` the kernels compile as before (HELD = 0).

Measured (H200, bench/kernels/moe.py, 30B-A3B layer, CUDA graphs, before the unsorted few-token
path): T=1 40 us against a 18 us roofline of its 8 experts (moe_align alone 9 us); T=8, 64, 256 at
0.85-0.90 of the roofline of the experts they touch; T=2048 270 TFLOP/s, 0.35 of the dense bf16
matmul rate; 40-75x faster than the torch loop. The five configs (16- to 128-row tiles, mma.sync
and wgmma) gave the same bits on the same tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels import pdl
from engine.kernels.launcher import Launcher
from engine.kernels.moe_align import held_bucket, max_blocks, moe_align
from engine.kernels.moe_routing import topk_softmax
from engine.kernels.moe_tiles import GemmConfig, gemm_configs, pair_tiles_apply
from engine.kernels.moe_workspace import MoeWorkspace, shared_workspace
from engine.kernels.split_kv import last_to_arrive

__all__ = ["MoeWorkspace", "fused_moe", "shared_workspace", "topk_softmax"]

# Triton's interpreter (TRITON_INTERPRET=1: the CPU tests) has no libdevice, and its bf16 tl.dot
# multiplies the raw 16-bit patterns: there the operands go to fp32 first (bf16 products are exact
# in fp32, so only the order of the sums differs from the GPU's).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot_t(a, b, acc, INTERPRET: tl.constexpr):
    # acc + a [M, K] @ b [N, K].T in fp32
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(b), acc)
    return acc


@Launcher
@triton.jit(do_not_specialize=["P"])
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K], unit last stride: x [T, H] (row = pair // TOP_K) or inter [P, I] (TOP_K = 1)
    w_ptr,  # [E, N_W, K] contiguous: w13 [E, 2N, K] (gate rows, then up) with SILU_MUL, else w2 [E, N, K]
    out_ptr,  # [P, N] by pair id, unit last stride
    sorted_ptr, expert_ids_ptr, num_padded_ptr,  # moe_align.py's outputs; PAIR_TILES: topk_ids [P] thrice
    sum_w_ptr, sum_out_ptr, count_ptr,  # SUM_K: routing weights [T, SUM_K], out [T, N], arrivals [T, grid n]
    P, N, K, stride_am, stride_om, stride_so,
    TOP_K: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
    PAIR_TILES: tl.constexpr, SUM_K: tl.constexpr,
    FIRST: tl.constexpr, HELD: tl.constexpr,  # HELD > 0: this rank's experts FIRST.. (HELD of them), ids the model's
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False,  # TRIGGER: launch dependents after the wait
):  # fmt: skip
    if USE_PDL:  # engine/kernels/pdl.py: launched while the kernel before it runs; wait for its output
        tl.extra.cuda.gdc_wait()
        if TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)  # fastest: neighbouring programs share an expert's weight columns
    pid_n = tl.program_id(1)
    if PAIR_TILES:  # tile m holds pair m alone (its other rows empty): no sort
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, P)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < P  # padding slots hold P
    rows = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if HELD > 0 and PAIR_TILES:  # the model's id of the pair's expert (sorted tiles hold buckets already)
        expert = held_bucket(expert, FIRST, HELD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N read row N-1, never stored
    offs_k = tl.arange(0, BLOCK_K)
    n_w = 2 * N if SILU_MUL else N
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + (expert * n_w + w_rows)[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N.to(tl.int64) * K  # the up half's rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = K
    if HELD > 0:  # another rank's expert: no K steps, zeros out
        k_end = tl.where(expert < HELD, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + offs_k)[None, :] < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = _dot_t(a, w, acc, INTERPRET)
        if SILU_MUL:
            if EVEN_K:
                u = tl.load(up_ptrs)
            else:
                u = tl.load(up_ptrs, mask=k_ok, other=0.0)
            acc_up = _dot_t(a, u, acc_up, INTERPRET)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if SILU_MUL:
        g = acc.to(dtype).to(tl.float32)
        u = acc_up.to(dtype).to(tl.float32)
        if INTERPRET:
            e = tl.exp(-g)
        else:
            e = libdevice.exp(-g)
        acc = tl.math.div_rn(g, 1.0 + e).to(dtype).to(tl.float32) * u
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(dtype), mask=valid[:, None] & (offs_n < N)[None, :])
    if SUM_K > 0:  # PAIR_TILES: token t's pairs are tiles t * SUM_K .. + SUM_K - 1
        t = pid_m // SUM_K
        if last_to_arrive(count_ptr + t * tl.num_programs(1) + pid_n, SUM_K):
            weighted_sum(out_ptr, sum_w_ptr, sum_out_ptr + t.to(tl.int64) * stride_so, t.to(tl.int64), offs_n,
                         offs_n < N, N, SUM_K, BLOCK_N, ".cg")  # fmt: skip


@triton.jit
def weighted_sum(y_ptr, w_ptr, dst_ptr, t, offs, mask, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 CACHE: tl.constexpr):  # fmt: skip
    # dst[offs] = round(sum over j in slot order of w[t, j] * y[t * TOP_K + j, offs]), in fp32: the
    # bits of a token's output depend on its own rows only.
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        acc += w * tl.load(y_ptr + (t * TOP_K + j) * N + offs, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    tl.store(dst_ptr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


@Launcher
@triton.jit
def _weighted_sum_kernel(
    y_ptr,  # [T * TOP_K, N] contiguous: each pair's down output
    w_ptr,  # [T, TOP_K] routing weights (any float dtype), contiguous
    out_ptr,  # [T, N], unit last stride
    N, stride_o,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weighted_sum(y_ptr, w_ptr, out_ptr + t * stride_o, t, offs, offs < N, N, TOP_K, BLOCK_N, "")


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")  # fmt: skip
    (T, H), (E, two_i, _) = x.shape, w13.shape
    if w13.shape != (E, two_i, H) or two_i % 2 or w2.shape != (E, H, two_i // 2):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} for hidden {H}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: one of bf16, fp16, fp32")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe: the expert weights must be contiguous")
    if ids.dim() != 2 or ids.shape[0] != T or weights.shape != ids.shape or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_weights {tuple(weights.shape)} and int topk_ids {tuple(ids.shape)} "
                         f"{ids.dtype} for {T} tokens")  # fmt: skip


def workspace_for(tokens: int, w2: torch.Tensor, top_k: int, first: int | None = None) -> MoeWorkspace:
    """The shared workspace `fused_moe` uses for up to `tokens` tokens of the experts w2 [E, H, I]
    (`first`: as fused_moe's; another rank's experts sort into one more bucket)."""
    E, H, inter_dim = w2.shape
    return shared_workspace(tokens, _buckets(E, first), top_k, H, inter_dim, w2.dtype, w2.device)


def _buckets(held: int, first: int | None) -> int:
    """The sort's buckets: the experts held, and with expert parallelism one for another rank's."""
    return held if first is None else held + 1


def fused_moe(
    x: torch.Tensor,  # [T, H], bf16/fp16/fp32, unit last stride
    w13: torch.Tensor,  # [E, 2I, H]: expert e's gate_proj rows, then its up_proj rows
    w2: torch.Tensor,  # [E, H, I]: down_proj
    topk_weights: torch.Tensor,  # [T, k] (fp32 from topk_softmax)
    topk_ids: torch.Tensor,  # [T, k] int32/int64 in [0, E)
    out: torch.Tensor | None = None,  # [T, H] of x's dtype, unit last stride: written in place
    workspace: MoeWorkspace | None = None,  # None: the process's shared one (moe_workspace.py)
    first: int | None = None,  # expert parallelism: w13 / w2 hold the model's experts first.., ids are the model's
    configs: tuple[GemmConfig, GemmConfig] | None = None,  # (gate_up, down) tiles (bench); None: gemm_configs
) -> torch.Tensor:  # [T, H]
    _check(x, w13, w2, topk_weights, topk_ids)
    (T, H), (E, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    inter_dim = two_i // 2
    buckets = _buckets(E, first)
    if out is None:
        out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    elif out.shape != (T, H) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"fused_moe: out {tuple(out.shape)} {out.dtype} for a [{T}, {H}] {x.dtype} result")
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ws = workspace or workspace_for(T, w2, k, first)
    ws.check(T, buckets, k, H, inter_dim, x.dtype)
    if torch.cuda.is_available() and x.is_cuda and torch.cuda.is_current_stream_capturing():
        ws.captured = True
    up, down = configs or gemm_configs(T, E, k, inter_dim, H, H, inter_dim, x.dtype)
    P = T * k
    pair_tiles = pair_tiles_apply(P, E)
    if pair_tiles:
        flat = topk_ids.view(-1) if topk_ids.is_contiguous() else topk_ids.reshape(-1)
        sorted_ids = expert_ids = num_padded = flat
        blocks = P
    else:
        sorted_ids, expert_ids, num_padded = moe_align(topk_ids, buckets, up.block_m, ws.align, first)
        blocks = max_blocks(P, buckets, up.block_m)
    inter, y = ws.inter[:P], ws.expert_out[:P]
    use_pdl = pair_tiles and pdl.enabled(x.device)
    gemms = ((up, x, w13, inter, inter_dim, H, k, True, 0), (down, inter, w2, y, H, inter_dim, 1, False, k if pair_tiles else 0))
    for cfg, a, w, dst, n, kdim, rows_per_token, silu_mul, sum_k in gemms:
        _grouped_gemm_kernel[(blocks, triton.cdiv(n, cfg.block_n))](
            a, w, dst, sorted_ids, expert_ids, num_padded, weights, out, ws.sum_counts,
            P, n, kdim, a.stride(0), dst.stride(0), out.stride(0),
            TOP_K=rows_per_token, SILU_MUL=silu_mul, EVEN_K=kdim % cfg.block_k == 0, INTERPRET=_INTERPRET,
            PAIR_TILES=pair_tiles, SUM_K=sum_k, FIRST=first or 0, HELD=0 if first is None else E,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=use_pdl, TRIGGER=sum_k > 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=use_pdl,
        )  # fmt: skip
    if pair_tiles:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _weighted_sum_kernel[(T, triton.cdiv(H, block))](
        y, weights, out, H, out.stride(0), TOP_K=k, BLOCK_N=block, num_warps=max(1, min(8, block // 256))
    )
    return out
