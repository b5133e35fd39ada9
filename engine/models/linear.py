"""The decoder families' linears: plain (`Linear`), row-parallel (`RowParallelLinear`: o_proj,
down_proj) and packed (`MergedLinear`: qkv_proj, gate_up_proj), with the kernels a fused CUDA
forward of few rows takes (`skinny_for`: skinny_linear.py; `splitk_for`: splitk_linear.py).

Rules:
- A weight is [out_features, in_features], created with `torch.empty` in the caller's default
  dtype and device; it holds garbage until engine/weights/loader.py loads a checkpoint.
- `fused` linears run the few-rows Triton matmul on half-precision CUDA inputs of few rows
  (decode steps); any other input runs `linear_fn` (torch's F.linear, or models/invariant.py's
  under `--deterministic`), the reference the kernels are tested against. Kernel modules are
  imported on first use by a CUDA tensor, so CPU installs never import Triton.
- `shards`: parameter name -> the part of its checkpoint tensor this tensor-parallel rank holds
  (none listed: all of it; the rules are engine/parallel.py's).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import Shard, TensorParallel


def skinny_for(x: torch.Tensor) -> ModuleType | None:
    """The few-rows matmul module (skinny_linear.py) when it applies to x [M, K], else None.
    Checked cheaply first, so a CPU forward never imports it."""
    if not x.is_cuda:
        return None
    from engine.kernels import skinny_linear

    return skinny_linear if skinny_linear.applies(x) else None


def splitk_for(x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
    """The split-K partial sums' module (splitk_linear.py) when it applies to a row-parallel
    linear of x [M, K], else None; checked cheaply first, as skinny_for."""
    if not x.is_cuda or x.dim() != 2:
        return None
    from engine.kernels import splitk_linear

    return splitk_linear if splitk_linear.applies(x, weight) else None


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features]; uninitialised until loaded.
    `fused`: a CUDA forward of few rows (decode) runs the skinny Triton matmul. `shards`: parameter
    name -> the part of its checkpoint tensor this rank holds (none listed: all of it; the rules are
    engine/parallel.py's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.fused = fused
        self.shards: dict[str, Shard] = {}

    # Whether the skinny kernel prefetches this weight while the kernel before it runs (see
    # engine/kernels/pdl.py): the packed linears, which always follow a norm.
    prefetch = False
    # The matmul of every other call: torch's, or models/invariant.py's (`--deterministic`).
    linear_fn = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skinny = skinny_for(x) if self.fused else None
        if skinny is not None:
            return skinny.skinny_linear(x, self.weight, self.bias, prefetch=self.prefetch)
        return self.linear_fn(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A linear keeping this rank's columns of the input features: each rank's partial product is
    summed by an all-reduce, then the bias (held whole by every rank) is added. Without a bias the
    sum is left to the RMSNorm after it (`tp.defers_reduce`): the output is this rank's partial.
    On one rank, fused, without a bias, at 1-64 rows of wide enough weights (splitk_linear.py) the
    output is [KS, T, N] fp32 partial sums over K, which the fused RMSNorm after it adds up."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fused: bool, tp: TensorParallel) -> None:
        shard = tp.even(in_features, f"input features of o/down_proj ({in_features})", dim=1)
        super().__init__(shard.length, out_features, bias, fused)
        self.tp = tp
        self.defers = tp.defers_reduce(bias)
        if not shard.whole:
            self.shards = {"weight": shard}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            splitk = splitk_for(x, self.weight) if self.fused and self.bias is None else None
            if splitk is not None:  # [KS, T, N] fp32: the fused RMSNorm after it sums them
                return splitk.splitk_parts(x, self.weight)
            return super().forward(x)
        skinny = skinny_for(x) if self.fused else None
        y = skinny.skinny_linear(x, self.weight, None) if skinny is not None else self.linear_fn(x, self.weight)
        if self.defers:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class MergedLinear(Linear):
    """Several checkpoint linears with the same input packed along the output dim, run as one
    matmul: e.g. q/k/v -> qkv_proj, gate/up -> gate_up_proj. `shards` (the constructor's) maps each
    checkpoint module name (`q_proj`) to the part of its output features this rank holds, in
    packing order; `rows` maps it to its rows of `weight` (and `bias`), which the loader fills."""

    prefetch = True

    def __init__(self, in_features: int, shards: dict[str, Shard], bias: bool = False, fused: bool = False) -> None:
        super().__init__(in_features, sum(s.length for s in shards.values()), bias, fused)
        self.rows: dict[str, slice] = {}
        self.parts: dict[str, Shard] = shards
        start = 0
        for name, shard in shards.items():
            self.rows[name] = slice(start, start + shard.length)
            start += shard.length
