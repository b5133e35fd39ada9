"""What the persistent-kernel decode paths (fused_decode.py: 1..4 rows, one launch per layer;
batch_decode.py: up to 64 rows, two per layer) share: the models they serve (`unsupported`), the
layer shape they compile for (`LayerShape`) and how they split a GEMV's K (`k_splits`).

Models they serve: Triton attention (`--deterministic`: its fixed-split backend, no qkv bias, and
the shape's RMSNorm and rotary kernels at INVARIANT_WARPS),
TP = 1, fused ops on, a half-precision CUDA model of dense MLPs (no mixture of experts) without
o_proj or MLP biases, hidden <= MAX_HIDDEN (the one shape measured: at the 8B shape's 4096 one
program per SM streams a layer's 24-96 MB slower than the skinny GEMVs' own grids,
bench/RESULTS.md), every GEMV K a multiple of 128, head_dim 64, 128 or 256.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers import MLP

MAX_HIDDEN = 1024
# A decode step of few rows whose rows hold this many context tokens together runs batch_decode.py's
# kernels (split-KV attention, three programs per SM) instead of fused_decode.py's one kernel per
# layer (one program per SM, at most 16 splits a row: its attention read the KV at ~1.2 TB/s).
# H200, 0.6B, one row (bench/history/2026-11-29.md, 2026-11-29p): the fused step is ~0.67 ms plus
# ~92 ns per context token, the batch decode's ~1.2 ms plus ~30 ns: even at ~8.5k tokens.
LONG_KV_TOKENS = 8192
# `--deterministic`'s batch decode runs this many warps, as the mode's RMSNorm and rotary kernels
# must at the model's shape (the 0.6B's: hidden 1024, 16 heads of 128), so its row sums of
# squares reduce in their order (bench/history/2026-12-01.md, entry b: 4 against 16 warps differed).
INVARIANT_WARPS = 4
_K_UNIT = 128  # every K of a layer's GEMVs is a multiple of this (the kernels' K steps)


def unsupported(model: nn.Module, backend: object, invariant: bool = False) -> str | None:
    """Why a persistent decode path cannot serve this model and backend (None: it can).
    `invariant` (`--deterministic`'s batch decode): the fixed-split backend, no qkv bias."""
    from engine.attention.triton import TritonBackend
    from engine.attention.triton_fixed import FixedSplitBackend

    if invariant and not isinstance(backend, FixedSplitBackend):
        return "attention backend is not triton_fixed"
    if not isinstance(backend, TritonBackend):
        return "attention backend is not triton"
    lm = model.model
    layer = lm.layers[0] if len(lm.layers) else None
    if layer is None or not lm.fused or model.tp.enabled:
        return "no layers, fused ops off or tensor parallel"
    if not all(isinstance(lay.mlp, MLP) for lay in lm.layers):
        return "mixture-of-experts layers"
    attn, mlp = layer.self_attn, layer.mlp
    w = attn.qkv_proj.weight
    if not w.is_cuda or w.dtype not in (torch.bfloat16, torch.float16):
        return "not a half-precision CUDA model"
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "o_proj or MLP bias"
    if invariant and attn.qkv_proj.bias is not None:
        return "qkv bias (the invariant kernel's qkv sum adds none)"
    if invariant:  # the kernel's norms and rope must reduce as the mode's own kernels do
        from engine.kernels.fused_ops import norm_warps
        from engine.kernels.rope import rotary_warps

        warps = (norm_warps(w.shape[1]), rotary_warps(attn.num_heads, attn.head_dim))
        if warps != (INVARIANT_WARPS, INVARIANT_WARPS):
            return f"the mode's norm and rotary kernels run {warps} warps at this shape, the invariant kernel {INVARIANT_WARPS}"
    hidden, inter = w.shape[1], mlp.down_proj.weight.shape[1]
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} > {MAX_HIDDEN}: the layers' own GEMVs are faster there"
    if hidden % _K_UNIT or inter % _K_UNIT or (attn.num_heads * attn.head_dim) % _K_UNIT:
        return f"hidden {hidden}, intermediate {inter} or heads not multiples of {_K_UNIT}"
    if attn.head_dim not in (64, 128, 256) or attn.num_heads // attn.num_kv_heads > 16:
        return "head_dim or GQA group outside what the kernels tile"
    return None


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer as the kernels see it (every layer of a model has the same)."""

    hidden: int
    inter: int  # intermediate size
    nh: int  # query heads
    nkv: int  # KV heads
    d: int  # head_dim
    eps: float  # RMSNorm epsilon
    qk_norm: bool  # Qwen3's per-head q/k RMSNorm
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, model: nn.Module) -> LayerShape:
        layer = model.model.layers[0]
        attn, w = layer.self_attn, layer.self_attn.qkv_proj.weight
        return cls(
            hidden=w.shape[1], inter=layer.mlp.down_proj.weight.shape[1], nh=attn.num_heads, nkv=attn.num_kv_heads,
            d=attn.head_dim, eps=layer.input_layernorm.eps, qk_norm=attn.q_norm is not None, device=w.device, dtype=w.dtype,
        )  # fmt: skip


def k_splits(tiles: int, k: int, programs: int, unit: int) -> int:
    """K splits of a GEMV phase: items (tiles * splits) within one wave, chunks of whole units."""
    return max(s for s in (1, 2, 4, 8) if s == 1 or (tiles * s <= programs and k % (s * unit) == 0))


def prefetch_width(k: int, want: int) -> int:
    """Weights per row that a persistent decode kernel's L2 prefetch covers (its *_PRE constants):
    `want` cut to the row's k, down to a power of two of 128-byte lines (64 bf16); 0 (none) below
    one line."""
    n = min(k, want) // 64
    return 0 if n < 1 else 64 << (n.bit_length() - 1)
