"""Mixture-of-experts routing on the GPU: softmax over the experts, top-k, renormalisation, in one
Triton kernel. Only CUDA code paths import this module (engine/kernels/fused_moe.py re-exports
`topk_softmax`, which engine/models/moe.py calls).

    probs [T, E]          = softmax(router_logits [T, E] in fp32)
    weights, ids [T, k]   = the k largest probs, largest first, and their expert ids
    weights              /= sum(weights)          (renormalize: Qwen3-MoE's `norm_topk_prob`)

Rules:
- The softmax and the weights are fp32 whatever the logits' dtype; exp is libdevice's expf and the
  divisions are IEEE (div_rn), as torch's CUDA softmax, so the weights equal the torch reference
  (engine/models/moe.py `route`) up to the order of the fp32 sums.
- Ties: among equal probabilities the lower expert id comes first and is picked first: the order
  of a stable descending sort. torch.topk promises no order among ties, on the CPU either (seen
  with torch 2.13: four equal probabilities of 128 returned as ids 1, 2, 3, 0), so a reference
  that must agree on ties sorts stably. Equal logits give bitwise equal probabilities, and bf16
  logits tie often (with 128 experts, several rows in a hundred).
- ids are int32 (the align kernel and the grouped GEMMs read them; a row id x E fits).
- One program per BLOCK_T rows, each row whole in registers (E <= MAX_EXPERTS); a row's result
  does not depend on the other rows. Grid and outputs fixed by T: CUDA-graph capturable, and
  `out` takes a caller's buffers (no allocation).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engine.kernels.launcher import Launcher

# libdevice's expf on a GPU; Triton's interpreter (TRITON_INTERPRET=1: the CPU tests) has no
# libdevice and gets tl.exp.
_LIBDEVICE_EXP = os.environ.get("TRITON_INTERPRET", "0") != "1"
MAX_EXPERTS = 1024  # a row of logits in one program's registers


@triton.jit
def topk_rows(
    x,  # [BLOCK_T, BLOCK_E] the rows' logits, any float dtype (columns past E and rows past T: anything)
    rows, row_ok, cols,  # [BLOCK_T] int64 row ids, [BLOCK_T] rows < T, [BLOCK_E] column ids
    weights_ptr, ids_ptr, E,  # outputs [T, K] fp32 / int32, contiguous
    K: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Softmax in fp32, the top K largest first (ties to the lower column), renormalised: stored.
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = tl.where(valid, x.to(tl.float32), float("-inf"))
    x = tl.where(row_ok[:, None], x, 0.0)  # rows past T: finite values, never stored
    shifted = x - tl.max(x, axis=1)[:, None]
    if LIBDEVICE_EXP:
        e = libdevice.exp(shifted)
    else:
        e = tl.exp(shifted)
    e = tl.where(valid, e, 0.0)
    total = tl.where(row_ok, tl.sum(e, axis=1), 1.0)  # >= 1 on a real row (its maximum gives exp(0))
    probs = tl.math.div_rn(e, tl.broadcast_to(total[:, None], (BLOCK_T, BLOCK_E)))
    probs = tl.where(valid, probs, -1.0)  # columns past E are never picked (probs >= 0)
    # One reduction a pick: a probability's bits (monotone in it, as it is >= 0) above 16 bits
    # holding BLOCK_E - 1 - column, so the maximum key is the largest probability at its lowest
    # column. A picked key becomes -1 (below every valid key; -1.0's bits make a negative key).
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 16) | (BLOCK_E - 1 - cols[None, :]).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(keys, axis=1)  # [BLOCK_T]
        idx = (BLOCK_E - 1 - (best & 0xFFFF)).to(tl.int32)
        w = (best >> 16).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(slots == j, w[:, None], top_w)
        top_i = tl.where(slots == j, idx[:, None], top_i)
        keys = tl.where(keys == best[:, None], -1, keys)
    if RENORMALIZE:
        total = tl.where(row_ok, tl.sum(top_w, axis=1), 1.0)  # slots past K hold 0
        top_w = tl.math.div_rn(top_w, tl.broadcast_to(total[:, None], (BLOCK_T, BLOCK_K)))
    out_mask = row_ok[:, None] & (slots < K)
    tl.store(weights_ptr + rows[:, None] * K + slots, top_w, mask=out_mask)
    tl.store(ids_ptr + rows[:, None] * K + slots, top_i, mask=out_mask)


@Launcher
@triton.jit(do_not_specialize=["T"])
def _topk_softmax_kernel(
    logits_ptr,  # [T, E], any float dtype, unit last stride
    weights_ptr,  # [T, K] fp32, contiguous
    ids_ptr,  # [T, K] int32, contiguous
    T, E, stride_l,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    valid = row_ok[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=valid, other=float("-inf"))
    topk_rows(x, rows, row_ok, cols, weights_ptr, ids_ptr, E, K, RENORMALIZE, LIBDEVICE_EXP, BLOCK_T, BLOCK_E, BLOCK_K)


def topk_outputs(
    T: int, k: int, device: torch.device, out: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] fp32, [T, k] int32)
    """The caller's `out` checked, or new tensors: where a top-k of T rows writes."""
    if out is None:
        return torch.empty((T, k), dtype=torch.float32, device=device), torch.empty((T, k), dtype=torch.int32, device=device)
    weights, ids = out
    if weights.shape != (T, k) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"top-k: out weights {tuple(weights.shape)} {weights.dtype}, want [{T}, {k}] fp32")
    if ids.shape != (T, k) or ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"top-k: out ids {tuple(ids.shape)} {ids.dtype}, want [{T}, {k}] int32")
    return weights, ids


def topk_softmax(
    router_logits: torch.Tensor,  # [T, E] (any float dtype)
    k: int,
    renormalize: bool,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, k] fp32, [T, k] int32) to write into
) -> tuple[torch.Tensor, torch.Tensor]:  # (topk_weights [T, k] fp32, topk_ids [T, k] int32), largest first
    if router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"topk_softmax: router_logits must be a float [T, E], got {tuple(router_logits.shape)} {router_logits.dtype}")
    T, E = router_logits.shape
    if not 0 < k <= E or E > MAX_EXPERTS:
        raise ValueError(f"topk_softmax: need 0 < k ({k}) <= E ({E}) <= {MAX_EXPERTS}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights, ids = topk_outputs(T, k, logits.device, out)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(16, 4096 // block_e))  # about 4096 values a program; fixed by E, not by T
    _topk_softmax_kernel[(triton.cdiv(T, block_t),)](
        logits, weights, ids, T, E, logits.stride(0),
        K=k, RENORMALIZE=renormalize, LIBDEVICE_EXP=_LIBDEVICE_EXP,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k),
        num_warps=4 if block_t * block_e <= 4096 else 8,
    )  # fmt: skip
    return weights, ids
