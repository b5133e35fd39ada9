"""A decode step's qkv projection left as fp32 partial sums for the fixed-split attention's
one-token-a-program kernel (attention_fixed.py `_token_kernel`, ROPE), which sums, norms and
rotates them itself and stores the new K/V rows (rope.rope_kv_head): `--deterministic`'s batch
decode past batch_consts.ROPE_LATER_ROWS rows (batch_kernel.py ROPE_LATER). `QkvParts` holds the
step's tensors; `token_args`, `token_values` and `token_consts` are what a launch of that kernel
passes for them (placeholders, and no ROPE, without them). Only CUDA code paths, and the CPU tests
under Triton's interpreter, import this module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kernels.attention import next_pow2


class QkvParts(NamedTuple):
    """The step's tensors; q is then `qkv`'s first NH * D columns."""

    parts: torch.Tensor  # [KS, R, QKV] fp32, R >= T
    qkv: torch.Tensor  # [R, QKV] scratch in the model dtype: the rounded sums, q and k rotated in place
    positions: torch.Tensor  # [T]
    cos_sin: torch.Tensor  # [max_positions, D] fp32: cos | sin
    q_weight: torch.Tensor | None  # [D]: Qwen3's per-head q/k RMSNorm weights (None: no norm)
    k_weight: torch.Tensor | None
    eps: float
    slots: torch.Tensor  # [T] int64: each token's cache slot (-1: none)


def token_args(rope: QkvParts | None, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`_token_kernel`'s ROPE tensors: parts, positions, cos_sin, q/k norm weights, slots (none: q six times)."""
    if rope is None:
        return (q,) * 6
    qw = rope.q_weight if rope.q_weight is not None else q
    kw = rope.k_weight if rope.k_weight is not None else q
    return rope.parts, rope.positions, rope.cos_sin, qw, kw, rope.slots


def token_values(rope: QkvParts | None) -> tuple[int, int, float]:
    """`_token_kernel`'s stride_part, stride_cos, eps."""
    return (0, 0, 0.0) if rope is None else (rope.parts.stride(0), rope.cos_sin.stride(0), rope.eps)


def token_consts(rope: QkvParts | None, num_heads: int, head_dim: int) -> dict[str, object]:
    """`_token_kernel`'s ROPE constexprs: the rotary kernel's blocks (rope.py `rope_token`)."""
    if rope is None:
        return {}
    if rope.qkv.stride(-1) != 1 or rope.qkv.shape[1] != rope.parts.shape[2] or rope.parts.stride(2) != 1:
        raise ValueError(f"fixed_split_attention: qkv {tuple(rope.qkv.shape)} and its parts {tuple(rope.parts.shape)}")
    kv_heads = (rope.qkv.shape[1] // head_dim - num_heads) // 2
    return dict(ROPE=True, KS=rope.parts.shape[0], NUM_HEADS=num_heads, QK_NORM=rope.q_weight is not None,
                BLOCK_HQ=next_pow2(num_heads), BLOCK_HK=next_pow2(kv_heads))
