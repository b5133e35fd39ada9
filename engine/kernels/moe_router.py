"""The router of a few-token mixture-of-experts step in one launch: its GEMV, then the top-k softmax
of moe_routing.py. Only CUDA code paths import this module (engine/models/moe.py).

    logits [T, E]        = round(x [T, H] @ gate [E, H].T)          (the model dtype)
    weights, ids [T, k]  = top-k of softmax(logits)                  (moe_routing.topk_rows)

Rules:
- For the steps whose experts take one tile a pair (moe_tiles.pair_tiles_apply: decode at T <= 4
  for top-8 of 128) in half precision: there a layer is a chain of launches a few microseconds
  each, and this one replaces two (bench/history/2026-11-29.md, the 30B-A3B batch-1 profile).
- One program per (TILE_E experts, K split): `splits(H)` chunks of whole BLOCK_K = 128 steps
  (8 of 256 at hidden 2048: 64 programs, each reading 8 KB of the router where 8 programs read 64
  KB in a chain of 16 loads), fp32 accumulation. Each split stores its fp32 partial tile; the
  last program to arrive (split_kv.last_to_arrive on the workspace's counter, zeroed by it for the
  next layer) sums a row's partials in split order, rounds once to the model dtype (the logits,
  also kept in the workspace), and runs the top-k on the T rows alone (next_pow2(T) of them:
  at T = 1 the 30B-A3B step took 2.965 ms against 3.207 with topk_softmax's 16 rows a program;
  bench/history/2026-12-01.md, entry f). A row's softmax sum then reduces in another order than
  topk_softmax's: the same ids, weights within an ulp or so. The logits depend on the row and the
  weight only; at one split they are the router Linear's skinny GEMV's bits.
- Grid fixed by E and H: CUDA-graph capturable; no allocation when the workspace and `out` are given.
- `prefetch` (on Hopper; engine/kernels/pdl.py): launched with PDL, a program pulls its chunk of its
  experts' router rows into L2 (pdl.prefetch_lines: the whole 0.5 MB of a 128 x 2048 router) while the
  post-attention norm before it runs, then waits for x; as the skinny GEMVs after a norm.
  Scheduling only: the same bits.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.launcher import Launcher
from engine.kernels.moe_routing import MAX_EXPERTS, topk_outputs, topk_rows
from engine.kernels.moe_workspace import ROUTER_ROWS, ROUTER_SPLITS, MoeWorkspace
from engine.kernels.split_kv import last_to_arrive

_LIBDEVICE_EXP = os.environ.get("TRITON_INTERPRET", "0") != "1"
TILE_E = 16  # experts per program: the skinny GEMV's column tile at this width
BLOCK_K = 128
WARPS = 4  # a program's warps: the top-k's picks reduce across them


def applies(x: torch.Tensor, num_experts: int) -> bool:
    """Whether `router_topk` takes these rows: half precision, at most ROUTER_ROWS of them, E <=
    MAX_EXPERTS (the caller checks that the experts' GEMMs take one tile a pair)."""
    return x.dtype in (torch.bfloat16, torch.float16) and 0 < x.shape[0] <= ROUTER_ROWS and num_experts <= MAX_EXPERTS


@Launcher
@triton.jit(do_not_specialize=["T"])
def _router_topk_kernel(
    x_ptr,  # [T, H], unit last stride
    w_ptr,  # [E, H] contiguous: the router's weight
    logits_ptr,  # [ROUTER_ROWS, E] scratch of x's dtype
    partials_ptr,  # [ROUTER_SPLITS, ROUTER_ROWS, E] fp32 scratch (read only when SPLIT > 1)
    weights_ptr, ids_ptr,  # [T, K] fp32 / int32, contiguous
    count_ptr,  # [1] int32, zero between calls
    T, E, H, stride_x,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr,
    SPLIT: tl.constexpr, TOPK_T: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
):  # fmt: skip
    pid_s = tl.program_id(1)
    chunk = H // SPLIT  # a multiple of BLOCK_K when SPLIT > 1
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(0) * TILE + tl.arange(0, TILE)
    offs_k = pid_s * chunk + tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    e_ok = offs_e < E
    if USE_PDL:  # engine/kernels/pdl.py: the router's weight is no kernel's output
        if PREFETCH_LINES > 0:
            w_rows = tl.minimum(offs_e, E - 1).to(tl.int64)[:, None] * H + pid_s * chunk  # [TILE, 1]
            w_lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE, chunk - 1)[None, :]  # [1, PREFETCH_LINES]
            pdl.prefetch_l2(w_ptr + w_rows + w_lines)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = x_ptr + offs_t[:, None] * stride_x + offs_k[None, :]  # [BLOCK_T, BLOCK_K]
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * H + offs_k[None, :]  # [TILE, BLOCK_K]
    acc = tl.zeros((BLOCK_T, TILE), dtype=tl.float32)
    for k0 in range(0, chunk, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=e_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < H
            x = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = logits_ptr.dtype.element_ty
    tile_mask = t_ok[:, None] & e_ok[None, :]
    if SPLIT == 1:
        tl.store(logits_ptr + offs_t[:, None] * E + offs_e[None, :], acc.to(dtype), mask=tile_mask)
    else:
        tl.store(partials_ptr + (pid_s * BLOCK_T + offs_t[:, None]) * E + offs_e[None, :], acc, mask=tile_mask)
    if last_to_arrive(count_ptr, tl.num_programs(0) * SPLIT):
        rows = tl.arange(0, TOPK_T).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < T
        mask = row_ok[:, None] & (cols < E)[None, :]
        if SPLIT == 1:
            logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        else:  # the splits' fp32 partials summed in split order, rounded once
            total = tl.zeros((TOPK_T, BLOCK_E), dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(partials_ptr + (j * BLOCK_T + rows[:, None]) * E + cols[None, :], mask=mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            logits = total.to(dtype)
            tl.store(logits_ptr + rows[:, None] * E + cols[None, :], logits, mask=mask)
        topk_rows(logits, rows, row_ok, cols, weights_ptr, ids_ptr, E, K, RENORMALIZE, LIBDEVICE_EXP,
                  TOPK_T, BLOCK_E, BLOCK_KS)  # fmt: skip


def splits(hidden: int, block_k: int = BLOCK_K) -> int:
    """K splits of the router's GEMV: up to ROUTER_SPLITS chunks of whole BLOCK_K steps, at least two
    steps each (one program a split and a tile of TILE_E experts)."""
    s = ROUTER_SPLITS
    while s > 1 and hidden % (s * 2 * block_k):
        s //= 2
    return s


def router_topk(
    x: torch.Tensor,  # [T, H] bf16/fp16, T <= ROUTER_ROWS
    gate: torch.Tensor,  # [E, H] the router's weight, x's dtype, contiguous
    k: int,
    renormalize: bool,
    workspace: MoeWorkspace,  # its router scratch and counter
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, k] fp32, [T, k] int32)
    prefetch: bool = False,  # launch with PDL and prefetch the router's weight: right after a norm
    split: int | None = None,  # K splits (bench); None: `splits(H)`
    warps: int | None = None,  # a program's warps (bench); None: WARPS
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_weights [T, k] fp32, topk_ids [T, k] int32), largest first
    T, H = x.shape
    E = gate.shape[0]
    if not applies(x, E) or gate.shape != (E, H) or gate.dtype != x.dtype or not gate.is_contiguous():
        raise ValueError(f"router_topk: x {tuple(x.shape)} {x.dtype} (half precision, <= {ROUTER_ROWS} rows) and "
                         f"a contiguous gate [E <= {MAX_EXPERTS}, {H}] of its dtype; got {tuple(gate.shape)} {gate.dtype}")
    if not 0 < k <= E or workspace.router_logits.shape[1] != E or workspace.router_logits.dtype != x.dtype:
        raise ValueError(f"router_topk: k {k} of {E} experts, workspace for {tuple(workspace.router_logits.shape)} "
                         f"{workspace.router_logits.dtype}")  # fmt: skip
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights, ids = topk_outputs(T, k, x.device, out)
    block_k = BLOCK_K if H >= BLOCK_K else max(16, triton.next_power_of_2(H))
    split = split or splits(H, block_k)
    if split > ROUTER_SPLITS or (split > 1 and H % (split * block_k)):
        raise ValueError(f"router_topk: {split} K splits of hidden {H} in {block_k}-wide steps")
    use_pdl = prefetch and pdl.enabled(x.device)
    line = pdl.LINE_BYTES // x.element_size()
    _router_topk_kernel[(triton.cdiv(E, TILE_E), split)](
        x, gate, workspace.router_logits, workspace.router_partials, weights, ids, workspace.router_count,
        T, E, H, x.stride(0),
        K=k, RENORMALIZE=renormalize, LIBDEVICE_EXP=_LIBDEVICE_EXP, EVEN_K=H % block_k == 0,
        BLOCK_T=ROUTER_ROWS, TILE=TILE_E, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(E), BLOCK_KS=triton.next_power_of_2(k),
        SPLIT=split, TOPK_T=triton.next_power_of_2(T),
        USE_PDL=use_pdl, PREFETCH_LINES=pdl.prefetch_lines(gate.numel() * gate.element_size(), H // split, line) if use_pdl else 0,
        LINE=line, num_warps=warps or WARPS, num_stages=5, launch_pdl=use_pdl,
    )  # fmt: skip
    return weights, ids
