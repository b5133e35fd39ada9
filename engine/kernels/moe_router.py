"""The router of a few-token mixture-of-experts step in one launch: its GEMV, then the top-k softmax
of moe_routing.py. Only CUDA code paths import this module (engine/models/moe.py).

    logits [T, E]        = round(x [T, H] @ gate [E, H].T)          (the model dtype)
    weights, ids [T, k]  = top-k of softmax(logits)                  (moe_routing.topk_rows)

Rules:
- For the steps whose experts take one tile a pair (fused_moe.pair_tiles_apply: decode at T <= 4
  for top-8 of 128) in half precision: there a layer is a chain of launches a few microseconds
  each, and this one replaces two (bench/history/2026-11-29.md, the 30B-A3B batch-1 profile).
- One program per TILE_E experts over all of H in BLOCK_K = 128 steps, fp32 accumulation, one
  rounding: skinny_linear's tiles (16 rows, 16 columns, 128), so the logits are the router
  Linear's bits at these sizes.
- Each program stores its logits tile into the workspace's scratch and counts itself done
  (split_kv.last_to_arrive); the last to arrive reads every tile back from L2 and runs the top-k,
  then zeroes the counter for the next layer. The counter lives in the MoE workspace (the
  `cuda_graph` region), zeroed again after a resume (MoeWorkspace.after_resume).
- Grid fixed by E: CUDA-graph capturable; no allocation when the workspace and `out` are given.
- `prefetch` (on Hopper; engine/kernels/pdl.py): launched with PDL, a program pulls its experts'
  router rows into L2 (pdl.prefetch_lines: the whole 0.5 MB of a 128 x 2048 router) while the
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
from engine.kernels.moe_workspace import ROUTER_ROWS, MoeWorkspace
from engine.kernels.split_kv import last_to_arrive

_LIBDEVICE_EXP = os.environ.get("TRITON_INTERPRET", "0") != "1"
TILE_E = 16  # experts per program: the skinny GEMV's column tile at this width
BLOCK_K = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
    weights_ptr, ids_ptr,  # [T, K] fp32 / int32, contiguous
    count_ptr,  # [1] int32, zero between calls
    T, E, H, stride_x,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_KS: tl.constexpr,
    USE_PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
):  # fmt: skip
    offs_t = tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(0) * TILE + tl.arange(0, TILE)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    e_ok = offs_e < E
    if USE_PDL:  # engine/kernels/pdl.py: the router's weight is no kernel's output
        if PREFETCH_LINES > 0:
            w_rows = tl.minimum(offs_e, E - 1).to(tl.int64)[:, None] * H  # [TILE, 1]
            w_lines = tl.minimum(tl.arange(0, PREFETCH_LINES) * LINE, H - 1)[None, :]  # [1, PREFETCH_LINES]
            pdl.prefetch_l2(w_ptr + w_rows + w_lines)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_ptrs = x_ptr + offs_t[:, None] * stride_x + offs_k[None, :]  # [BLOCK_T, BLOCK_K]
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * H + offs_k[None, :]  # [TILE, BLOCK_K]
    acc = tl.zeros((BLOCK_T, TILE), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
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
    tl.store(logits_ptr + offs_t[:, None] * E + offs_e[None, :], acc.to(dtype), mask=t_ok[:, None] & e_ok[None, :])
    if last_to_arrive(count_ptr, tl.num_programs(0)):
        rows = tl.arange(0, BLOCK_T).to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        row_ok = rows < T
        mask = row_ok[:, None] & (cols < E)[None, :]
        logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        topk_rows(logits, rows, row_ok, cols, weights_ptr, ids_ptr, E, K, RENORMALIZE, LIBDEVICE_EXP,
                  BLOCK_T, BLOCK_E, BLOCK_KS)  # fmt: skip


def router_topk(
    x: torch.Tensor,  # [T, H] bf16/fp16, T <= ROUTER_ROWS
    gate: torch.Tensor,  # [E, H] the router's weight, x's dtype, contiguous
    k: int,
    renormalize: bool,
    workspace: MoeWorkspace,  # its router scratch and counter
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, k] fp32, [T, k] int32)
    prefetch: bool = False,  # launch with PDL and prefetch the router's weight: right after a norm
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
    block_k = BLOCK_K if H >= BLOCK_K else max(16, _next_pow2(H))
    use_pdl = prefetch and pdl.enabled(x.device)
    line = pdl.LINE_BYTES // x.element_size()
    _router_topk_kernel[(triton.cdiv(E, TILE_E),)](
        x, gate, workspace.router_logits, weights, ids, workspace.router_count,
        T, E, H, x.stride(0),
        K=k, RENORMALIZE=renormalize, LIBDEVICE_EXP=_LIBDEVICE_EXP, EVEN_K=H % block_k == 0,
        BLOCK_T=ROUTER_ROWS, TILE=TILE_E, BLOCK_K=block_k, BLOCK_E=_next_pow2(E), BLOCK_KS=_next_pow2(k),
        USE_PDL=use_pdl, PREFETCH_LINES=pdl.prefetch_lines(gate.numel() * gate.element_size(), H, line) if use_pdl else 0,
        LINE=line, num_warps=4, num_stages=5, launch_pdl=use_pdl,
    )  # fmt: skip
    return weights, ids
