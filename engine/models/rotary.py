"""Rotary position embedding: the inverse frequencies (with Llama 3 / linear scaling), the cos/sin
cache computed once per model, and the torch rotation that is the reference of the fused kernel
(engine/kernels/rope.py `rotary`). Shapes: T new tokens, D the head dim; the cache is always float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from engine.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32: theta^(-2i / head_dim), then scaled.

    linear: every frequency / factor (the same as positions / factor).
    llama3: wavelengths longer than original_len / low_freq_factor are divided by factor, shorter
    than original_len / high_freq_factor are kept, and those in between blend the two linearly in
    original_len / wavelength.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type != "llama3":
        raise ValueError(f"rope scaling {scaling.type!r} is not implemented")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(medium, blended, scaled)


class RopeInputs(NamedTuple):
    """What the attention layers rotate q and k with, computed once per forward."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_positions, D] float32
    cos: torch.Tensor | None  # [T, 1, D/2] float32, None when not gathered
    sin: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout: dims i and i + D/2 form a pair.

    `cos_sin_cache` [max_positions, D] holds cos(p * f) | sin(p * f) for every position p, computed
    once at init in float32. It is a buffer left out of the state dict (checkpoints never carry
    it); a model built on the meta device must call `reset_cache()` after materialising.
    """

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer(
            "cos_sin_cache", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False
        )
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        """(Re)compute the cache in place: its address never changes. Computed on the CPU, so
        the values do not depend on the device."""
        if self.cos_sin_cache.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, D/2]
        self.cos_sin_cache.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1))

    def forward(self, positions: torch.Tensor, gather: bool = True) -> RopeInputs:
        """positions [T] -> what the attention layers rotate with. `gather`: look up cos, sin, each
        [T, 1, D/2] float32 (the 1 broadcasts over heads), for the torch path; the fused kernel
        reads the cache itself and needs no lookup."""
        cos = sin = None
        if gather:
            cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return RopeInputs(positions, self.cos_sin_cache, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_i, x_{i+D/2}) of x [T, heads, D] by its angle, rounding as Hugging Face
    does: cos and sin cast to x's dtype, then `x * cos + rotate_half(x) * sin` in x's dtype (each
    product and the sum rounded). In float32 that is plain float32 rope."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
