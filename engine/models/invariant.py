"""Batch-invariant ops for `--deterministic` (EngineConfig.deterministic): a token's result
depends on its own inputs only, never on how many other rows share its matmuls.

    linear(x [T, K], weight [N, K], bias [N]) -> [T, N]     F.linear on ROW_BLOCK-row blocks
    logits(hidden [T, H], weight [V, H], out) -> [T, V]     the same, into `out` when given
    cuda_linear / cuda_logits                               on CUDA in bf16 / fp16: engine/kernels/invariant_matmul.py

Rules:
- A GEMM's reduction order over K is chosen by its shape (BLAS kernels block M, N and K by the
  sizes they see: torch 2.13's CPU F.linear rounds a 1-3-row product differently from the same
  rows inside a larger one). Every product here has one shape, [ROW_BLOCK, K] x [K, N]: the
  rows are cut into blocks of ROW_BLOCK, the last padded with zeros, so a row's bits are the same
  alone, in a batch, in a prefill chunk or in a decode step.
- On CUDA a half-precision matmul is invariant_matmul's (one tile and K-chunk order per weight
  shape, any rows); fp32 keeps the blocks (cuBLAS picks one kernel for one shape).
- `install(model, device, arrivals)` switches every linear of a built model to these, once, at
  startup (on CUDA with `reserve`'s counters: a split matmul sums its chunks in its last
  program; the linears that follow a norm, `prefetch` in layers.py, and the lm_head launch with
  PDL and prefetch their weights, as the default mode's skinny kernel does), and turns off the
  few-row kernels that bypass them (the skinny and split-K linears, the MLP's skinny gate_up +
  SiLU, the skinny lm_head, a decode graph's logits pieces): the default mode's forward keeps
  its own code (no branch per call).
- Attention is the backend's (engine/attention/triton_fixed.py on CUDA, with CUDA graphs;
  sdpa_rows.py elsewhere); norms (one row a program on CUDA), rotary, activations and the
  sampler's row-wise ops are invariant as they are. A mixture of experts runs the torch reference
  (models/moe.py `reference_moe`: each expert's matmul through the hook, a token's experts added
  in ascending expert id), eagerly on CUDA. At tensor parallelism the ranks' partial sums meet in
  rank order (engine/parallel.py `TensorParallel.ordered`).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.kernels.invariant_matmul import Arrivals

ROW_BLOCK = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias) in blocks of ROW_BLOCK rows -> [..., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    t = rows.shape[0]
    pad = -t % ROW_BLOCK
    if pad or not rows.is_contiguous():
        rows = torch.cat([rows, rows.new_zeros(pad, k)]) if pad else rows.contiguous()
    out = torch.cat([F.linear(block, weight, bias) for block in rows.split(ROW_BLOCK)]) if t else rows.new_empty(0, weight.shape[0])
    return out[:t].reshape(*lead, weight.shape[0])


def logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The lm_head's [T, V] logits by `linear`, into `out` [T, V] when given."""
    result = linear(hidden, weight)
    return result if out is None else out.copy_(result)


def cuda_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, arrivals: Arrivals | None = None,
    prefetch: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`linear` on CUDA: half precision through invariant_matmul (`arrivals`: `reserve`'s; `prefetch`:
    a GEMM right after a norm, launched with PDL), fp32 in blocks."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return linear(x, weight, bias)
    from engine.kernels.invariant_matmul import invariant_matmul

    lead, k = x.shape[:-1], x.shape[-1]
    out = invariant_matmul(x.reshape(-1, k), weight, arrivals=arrivals, prefetch=prefetch).reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias


def cuda_logits(
    hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, arrivals: Arrivals | None = None
) -> torch.Tensor:
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        return logits(hidden, weight, out)
    from engine.kernels.invariant_matmul import invariant_matmul

    return invariant_matmul(hidden, weight, out=out, arrivals=arrivals, prefetch=True)  # behind the final norm


def reserve(device: torch.device) -> Arrivals | None:
    """CUDA: the split matmuls' arrival counters (invariant_matmul.Arrivals), allocated now in the
    region the caller has entered (`cuda_graph`); None elsewhere."""
    if torch.device(device).type != "cuda":
        return None
    from engine.kernels.invariant_matmul import Arrivals

    return Arrivals(torch.device(device))


def install(model: nn.Module, device: torch.device, arrivals: Arrivals | None = None) -> int:
    """Point every module's matmul hook (`linear_fn`, `logits_fn`: the class defaults are torch's
    own) at this file's ops for `device` (on CUDA with `reserve`'s `arrivals`), and turn off the
    few-row paths that bypass the hooks; returns how many modules changed."""
    from engine.models.layers import MLP
    from engine.models.moe import SparseMoE

    cuda = torch.device(device).type == "cuda"
    changed = 0
    for module in model.modules():
        if isinstance(module, MLP):
            module.fused = False  # no skinny gate_up + SiLU kernel: gate_up_proj's hook, then the activation
        if isinstance(module, SparseMoE):
            module.kernels = False  # the torch reference: the experts' hook, a token's experts in expert order
        if hasattr(type(module), "linear_fn"):
            prefetch = bool(getattr(module, "prefetch", False))  # the packed linears, after a norm (layers.py)
            module.linear_fn = partial(cuda_linear, arrivals=arrivals, prefetch=prefetch) if cuda else linear
            if hasattr(module, "fused") and hasattr(module, "weight"):
                module.fused = False  # a Linear: no skinny or split-K kernel
            changed += 1
        if hasattr(type(module), "logits_fn"):
            module.logits_fn = partial(cuda_logits, arrivals=arrivals) if cuda else logits
            module.skinny_logits = False
            module.use_logits_pieces = False  # a decode graph's logits: logits_fn too
            changed += 1
    return changed
