"""Batch-invariant ops for `--deterministic` (EngineConfig.deterministic) on a CPU: a token's
result depends on its own inputs only, never on how many other rows share its matmuls.

    linear(x [T, K], weight [N, K], bias [N]) -> [T, N]     F.linear on ROW_BLOCK-row blocks
    logits(hidden [T, H], weight [V, H], out) -> [T, V]     the same, into `out` when given

Rules:
- A GEMM's reduction order over K is chosen by its shape (BLAS kernels block M, N and K by the
  sizes they see: torch 2.13's CPU F.linear rounds a 1-3-row product differently from the same
  rows inside a larger one). Every product here has one shape, [ROW_BLOCK, K] x [K, N]: the
  rows are cut into blocks of ROW_BLOCK, the last padded with zeros, so a row's bits are the same
  alone, in a batch, in a prefill chunk or in a decode step.
- `install(model)` switches every linear of a built model to these, once, at startup: the
  default mode's forward keeps its own code (no branch per call).
- Attention is the backend's (engine/attention/sdpa_rows.py); norms, rotary, activations and
  the sampler's row-wise ops are invariant as they are (each row alone). The CUDA kernels'
  invariant variants do not exist yet: the engine refuses `--deterministic` on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def install(model: nn.Module) -> int:
    """Point every module's matmul hook (`linear_fn`, `logits_fn`: the class defaults are torch's
    own) at this file's ops; returns how many modules changed."""
    changed = 0
    for module in model.modules():
        if hasattr(type(module), "linear_fn"):
            module.linear_fn = linear
            changed += 1
        if hasattr(type(module), "logits_fn"):
            module.logits_fn = logits
            changed += 1
    return changed
