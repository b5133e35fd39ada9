"""Building blocks of the decoder families: the embedding, RMSNorm, SiLU-and-mul, the attention and
MLP blocks (the linears are linear.py's, the rotary embedding rotary.py's).

Shapes: T is the number of new tokens in the step (sequences concatenated, see
engine/attention/base.py), H / Hkv the query / KV heads, D the head dim.

Parameters are created with `torch.empty` in the current default dtype and device (the caller's
`torch.device(...)` context and `torch.set_default_dtype`): they hold garbage until
engine/weights/loader.py loads a checkpoint. The rotary cache is the one tensor computed here; it is
always float32.

Fused ops: a module built with `fused=True` runs the Triton kernels of `fused_ops.py` on CUDA
tensors (RMSNorm with the residual add, q/k norm with rope, SiLU-and-mul), and its linears run
the few-rows matmul of `skinny_linear.py` on half-precision CUDA inputs of few rows (decode
steps; the MLP's gate_up then applies SiLU-and-mul in the same kernel); any other device runs
this file's torch code, the reference the kernels are tested against. The model resolves the
flag once, at construction (`fused_ops_default`, `--no-fused-ops`).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import ForwardContext
from engine.config import ModelConfig
from engine.models.linear import MergedLinear, RowParallelLinear, skinny_for
from engine.models.rotary import RopeInputs, apply_rotary
from engine.parallel import Shard, TensorParallel

if TYPE_CHECKING:
    from engine.models.hooks import DecodeAttentionPath


def fused_ops_default() -> bool:
    """Whether a model built without a say uses the fused ops on CUDA: when Triton is installed
    (`--no-fused-ops` builds it with fused=False). Read at model construction, never per step."""
    return importlib.util.find_spec("triton") is not None


def _fused_ops() -> ModuleType:
    # Imported on first use by a CUDA tensor, so CPU installs never import Triton.
    from engine.kernels import fused_ops

    return fused_ops


def _rope() -> ModuleType:
    from engine.kernels import rope  # as _fused_ops

    return rope


class Embedding(nn.Module):
    """Token id -> row of weight [vocab rows, hidden]; uninitialised until loaded. With tensor
    parallelism each rank holds `tp.vocab_shard` of the rows: ids outside it look up zero and an
    all-reduce sums the ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp or TensorParallel()
        self.shard = self.tp.vocab_shard(num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.tp.vocab_rows(num_embeddings), embedding_dim), requires_grad=False
        )
        self.shards: dict[str, Shard] = {} if self.shard.whole else {"weight": self.shard}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        inside = (local >= 0) & (local < self.shard.length)
        rows = F.embedding(torch.where(inside, local, 0), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(rows)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim. The normalisation runs in float32 and is cast back
    before the weight multiply, as in Hugging Face, so half-precision results match it.

    With a residual (the vLLM way): residual = residual + x, then (norm(residual), residual). The
    fused CUDA kernel updates `residual` in place; callers use the returned one either way.
    With `reduce` (a TensorParallel), x beside a residual is a row-parallel layer's partial sum:
    it is all-reduced first, in the same kernel as the add and the norm when `reduce.fused` fits.
    """

    def __init__(self, size: int, eps: float, fused: bool = False, reduce: TensorParallel | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps
        self.fused = fused
        self.reduce = reduce

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.reduce is not None and residual is not None:
            fast = self.reduce.fused
            if fast is not None and fast.fits(x):
                return fast.add_rms_norm(x, residual, self.weight, self.eps)
            x = self.reduce.all_reduce(x)
        if self.fused and x.is_cuda:
            if residual is None:
                return _fused_ops().rms_norm(x, self.weight, self.eps)
            return _fused_ops().fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class SiluAndMul(nn.Module):
    """[..., 2I] (gate | up) -> silu(gate) * up, [..., I]."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.is_cuda:
            return _fused_ops().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class Attention(nn.Module):
    """qkv_proj -> (per-head q/k RMSNorm) -> rope -> paged attention -> o_proj.

    qkv_bias: bias on q/k/v (Qwen2, Llama with attention_bias); o_bias: bias on o_proj (Llama with
    attention_bias); qk_norm: RMSNorm over head_dim of each q and k head before rope (Qwen3).
    `decode_attention` (hooks.py; attached by the model runner on CUDA): decode steps run the
    qkv projection, then the norm, rope, K/V store and attention as one kernel on its output.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        fused: bool = False,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.layer_id = layer_id
        self.fused = fused
        self.head_dim = D = config.head_dim
        self.num_heads = tp.split(config.num_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads = tp.kv_heads(config.num_kv_heads)
        q = tp.even(config.num_heads * D, "q_proj rows")
        kv = tp.kv_shard(config.num_kv_heads, D)
        self.qkv_proj = MergedLinear(config.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, qkv_bias, fused)
        self.o_proj = RowParallelLinear(config.num_heads * D, config.hidden_size, o_bias, fused, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.decode_attention: DecodeAttentionPath | None = None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rope: RopeInputs,
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        T, H, D = hidden.shape[0], self.num_heads, self.head_dim
        if self.decode_attention is not None and self.decode_attention.applies(hidden, ctx):
            return self.o_proj(self.decode_attention(self, hidden, rope, ctx).view(T, H * D))
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) D]
        if self.fused and hidden.is_cuda:
            return self.o_proj(self.attend_qkv(qkv, rope, ctx).reshape(T, H * D))
        q, k, v = self._heads(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        assert rope.cos is not None and rope.sin is not None
        q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        out = ctx.backend.forward(self.layer_id, q, k, v, ctx.meta)  # [T, H, D]
        return self.o_proj(out.reshape(T, H * D))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [T, (H + 2 Hkv) D] -> views q [T, H, D], k and v [T, Hkv, D]
        T, H, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)

    def attend_qkv(self, qkv: torch.Tensor, rope: RopeInputs, ctx: ForwardContext) -> torch.Tensor:
        """The fused CUDA attention of this layer's qkv output [T, (H + 2 Hkv) D] -> [T, H, D]:
        one kernel for the q/k norm (if any) and rope, in place in qkv, and the K/V rows into the
        cache where the backend lets it (then it only attends)."""
        q, k, v = self._heads(qkv)
        qw = self.q_norm.weight if self.q_norm is not None else None
        kw = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        target = ctx.backend.kv_target(self.layer_id, ctx.meta)
        store = None if target is None else (v, *target)
        q, k = _rope().rotary(q, k, rope.positions, rope.cos_sin_cache, qw, kw, eps, kv_store=store)
        if target is not None:
            return ctx.backend.attend(self.layer_id, q, ctx.meta)
        return ctx.backend.forward(self.layer_id, q, k, v, ctx.meta)


class MLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), gate and up packed into one matmul. A fused
    CUDA forward of few rows computes gate_up and the activation in one skinny kernel."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, fused: bool = False, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.fused = fused
        part = tp.even(intermediate_size, "intermediate_size")
        self.gate_up_proj = MergedLinear(hidden_size, {"gate_proj": part, "up_proj": part}, bias, fused)
        self.act = SiluAndMul(fused)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, fused, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        skinny = skinny_for(x) if self.fused else None
        if skinny is not None:
            w = self.gate_up_proj
            return self.down_proj(skinny.skinny_linear(x, w.weight, w.bias, silu_mul=True, prefetch=w.prefetch))
        return self.down_proj(self.act(self.gate_up_proj(x)))
