"""The Llama decoder, shared by every family Siesta serves: Llama and Mistral use it as is, Qwen2,
Qwen3 and Qwen3-MoE (qwen2.py, qwen3.py, qwen3_moe.py) only change `DecoderOptions`.

Parameter names match the Hugging Face checkpoints (`model.layers.0.self_attn.o_proj.weight`, ...)
except the packed linears: `qkv_proj` holds q/k/v_proj, `gate_up_proj` holds gate/up_proj (see
`MergedLinear.rows`), and a sparse layer's experts (moe.py `PackedExperts`). With tensor
parallelism (`tp`) every rank builds its own slice of each parameter (engine/parallel.py has the
rules) under the same names.

Construction: `cls(config)` creates parameters in the current default dtype and on the current
default device, so build it inside `torch.device(dev)` with `torch.set_default_dtype(dtype)` set;
never `.to(dtype)` it afterwards (that would cast the float32 rotary cache too). Parameters are
uninitialised until engine/weights/loader.py loads them. Built on the meta device, materialise it with
`to_empty(device=...)` and then call `init_buffers()`.

`cls(config, fused=None, logits_pieces=True)`: whether CUDA forwards use the fused Triton ops of
engine/kernels/fused_ops.py (see layers.py; None: when Triton is installed, `fused_ops_default`).
A CPU forward always runs the torch ops. logits_pieces=False (`--no-logits-pieces`): a decode
graph's sampler reads the logits instead of the pieces their epilogue writes (`logits_pieces`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import ForwardContext
from engine.config import ModelConfig
from engine.models.hooks import DecodeAttentionPath, DecodeStepPath
from engine.models.layers import (
    MLP,
    Attention,
    Embedding,
    RMSNorm,
    fused_ops_default,
)
from engine.models.linear import Linear, skinny_for
from engine.models.moe import SparseMoE
from engine.models.rotary import RopeInputs, RotaryEmbedding
from engine.models.routed_experts import RoutedExperts
from engine.parallel import TensorParallel

if TYPE_CHECKING:
    from engine.kernels.moe_workspace import MoeWorkspace


@dataclass(frozen=True)
class DecoderOptions:
    """What differs between the families that share this decoder."""

    qkv_bias: bool = False  # bias on q/k/v_proj
    o_bias: bool = False  # bias on o_proj
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope
    mlp_bias: bool = False  # bias on gate/up/down_proj
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse mixture of experts (moe.py)


class DecoderLayer(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)), with the residual stream carried
    beside the block's output (the vLLM way) so that each add is fused into the next norm:

        x, residual = input_layernorm(x, residual)   # residual += x; x = norm(residual)
        x = self_attn(x)
        x, residual = post_attention_layernorm(x, residual)
        x = mlp(x)                                   # -> (x, residual); h = x + residual

    The first layer gets residual None: the embedding is the residual and only normed.
    """

    def __init__(
        self, config: ModelConfig, layer_id: int, options: DecoderOptions, fused: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        # Registered in Hugging Face's order: the weights region lays parameters out in it
        # (engine/weights/store.py), so a trainer's flattened bucket lands there in one piece.
        self.self_attn = Attention(
            config, layer_id, options.qkv_bias, options.o_bias, options.qk_norm, fused, tp
        )
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, layer_id, fused, tp) if layer_id in options.moe_layers
            else MLP(config.hidden_size, config.intermediate_size, options.mlp_bias, fused, tp)
        )  # fmt: skip
        # Each norm after a row-parallel layer (the previous layer's down_proj, this one's o_proj)
        # sums its partial output across ranks, fused with the residual add.
        after_down = tp if tp.defers_reduce(options.mlp_bias) else None
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused, reduce=after_down)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps, fused, reduce=tp if tp.defers_reduce(options.o_bias) else None
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's output (the embedding for layer 0)
        residual: torch.Tensor | None,  # [T, hidden]: the stream before x; None at layer 0
        rope: RopeInputs,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the stream before it)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm; `model.` in checkpoint names."""

    def __init__(self, config: ModelConfig, options: DecoderOptions, fused: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.fused = fused
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, options, fused, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, fused, reduce=tp if tp.defers_reduce(options.mlp_bias) else None
        )
        # One rotary table for all layers; cos/sin are looked up once per forward.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # Faster paths for whole decode steps (hooks.py), tried in order; none until attached.
        self.decode_paths: tuple[DecodeStepPath, ...] = ()

    def use_decode_paths(self, steps: list[DecodeStepPath], attention: DecodeAttentionPath | None) -> None:
        """Hand decode steps to these paths (the model runner, once, on CUDA): a whole step to the
        first of `steps` that applies, else each layer's attention to `attention` where it applies."""
        self.decode_paths = tuple(steps)
        for layer in self.layers:
            layer.self_attn.decode_attention = attention

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # [T] int64, [T] int64 -> [T, hidden]
        for path in self.decode_paths:
            if path.applies(input_ids, ctx):
                return path.forward(input_ids, positions, ctx)
        x = self.embed_tokens(input_ids)
        # The fused rope kernel reads the cos/sin cache itself; the torch path looks them up once.
        rope = self.rotary_emb(positions, gather=not (self.fused and positions.is_cuda))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, ctx)
        if residual is None:  # no layers
            return self.norm(x)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """A causal LM over the ragged batch layout.

    hidden = model(input_ids [T], positions [T], ctx) -> [T, hidden]
    logits = model.compute_logits(hidden[rows]) -> [n, vocab] in the model dtype
    """

    # The lm_head's matmul where no kernel of ours runs it: torch's, or models/invariant.py's
    # (`--deterministic`); `linear_fn` at tensor parallelism, `logits_fn` on one rank.
    linear_fn = staticmethod(F.linear)
    logits_fn = staticmethod(lambda hidden, weight, out: torch.matmul(hidden, weight.T, out=out))
    skinny_logits = True  # few rows through skinny_linear (models/invariant.py turns it off)

    def __init__(
        self, config: ModelConfig, fused: bool | None = None, tp: TensorParallel | None = None, logits_pieces: bool = True
    ) -> None:
        super().__init__()
        self.config = config
        self.use_logits_pieces = logits_pieces
        self.tp = tp = tp or TensorParallel()
        self.fused = fused_ops_default() if fused is None else fused
        self.model = DecoderModel(config, self.decoder_options(config), self.fused, tp)
        # Tied: the logits reuse model.embed_tokens.weight and there is no lm_head parameter.
        # Either way each rank holds the vocabulary rows `tp.vocab_shard` names.
        self.routed_experts: RoutedExperts | None = None  # capture_routed_experts
        # Speculative decoding's draft model, riding in this model's weights as `draft.` (engine/runner/draft_model.py).
        self.draft: nn.Module | None = None
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, tp.vocab_rows(config.vocab_size), bias=False)
            self.lm_head.shards = self.model.embed_tokens.shards

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        # Llama's `attention_bias` covers q, k, v and o.
        return DecoderOptions(
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None,
        lse: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """[n, hidden] -> [n, vocab] logits in the model dtype (the sampler computes in fp32),
        written into `out` [n, vocab] when given (a CUDA graph's static buffer: no copy). Up to
        skinny_linear.MAX_ROWS rows on CUDA with the fused ops: skinny_linear's LOGITS_CONFIG.
        `lse` (temperatures [n], then [n, logits_pieces(n)] maxima, sums, argmaxes; a decode
        graph's logits, up to 64 rows, into `out`): the logits also write the sampler's pieces
        (engine/kernels/logits_linear.py)."""
        weight = self._logits_weight()
        if not self.tp.enabled:
            if lse is not None:
                from engine.kernels import logits_linear

                assert out is not None
                return logits_linear.logits_linear(hidden, weight, out, lse)
            skinny = skinny_for(hidden) if self.model.fused and self.skinny_logits and weight.is_contiguous() else None
            if skinny is not None:  # few rows (decode): the weight prefetched behind the final norm
                return skinny.skinny_linear(hidden, weight, out=out, prefetch=True, **skinny.LOGITS_CONFIG)
            return self.logits_fn(hidden, weight, out)
        logits = self.tp.all_gather_last(self.linear_fn(hidden, weight))[:, : self.config.vocab_size]
        return logits if out is None else out.copy_(logits)

    def logits_pieces(self, rows: int) -> int:
        """Pieces per row of the sampler's log-sum-exp that compute_logits(lse=...) writes for
        `rows` rows (engine/kernels/lse_argmax.py merges them), 0 where it cannot: not on CUDA in
        half precision with the fused ops on one rank, more than logits_linear.MAX_ROWS rows, a
        hidden size no K step divides, or built with logits_pieces=False (the sampler then reads the logits)."""
        weight = self._logits_weight()
        half = weight.dtype in (torch.bfloat16, torch.float16)
        if self.tp.enabled or not self.model.fused or not weight.is_cuda or not half or not weight.is_contiguous():
            return 0
        from engine.kernels import logits_linear

        if not self.use_logits_pieces or not 0 < rows <= logits_linear.MAX_ROWS:
            return 0
        if not logits_linear.block_k(weight.shape[1]):
            return 0
        return logits_linear.pieces(weight.shape[0], weight.device)

    def _logits_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def sparse_layers(self) -> list[SparseMoE]:
        """The mixture-of-experts MLPs, in layer order ([] for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def reserve_workspaces(self, max_tokens: int) -> list[MoeWorkspace]:
        """The buffers the fused MoE kernels share across layers and CUDA-graph sizes, allocated now
        for steps of up to `max_tokens` tokens (the model runner: inside the `cuda_graph` region,
        before the KV profile and every capture); one per distinct layer shape, [] when dense."""
        found = {id(ws): ws for ws in (mlp.reserve(max_tokens) for mlp in self.sparse_layers())}
        return list(found.values())

    def capture_routed_experts(self, max_tokens: int) -> RoutedExperts:
        """From now on every forward records each sparse layer's top-k expert ids for steps of up
        to `max_tokens` tokens (routed_experts.py), in a buffer allocated here, on the weights'
        device (the model runner: inside the `cuda_graph` region). ValueError for a model without
        sparse layers."""
        moe = self.sparse_layers()
        if not moe:
            raise ValueError(f"{self.config.architecture} has no mixture-of-experts layers to record")
        device = self.model.embed_tokens.weight.device
        routed = RoutedExperts(self.config.num_layers, moe[0].top_k, max_tokens, device)
        for mlp in moe:
            mlp.routed = routed
        self.routed_experts = routed
        return routed

    def init_buffers(self) -> None:
        """Recompute computed (non-checkpoint) buffers, after `to_empty` from the meta device."""
        self.model.rotary_emb.reset_cache()
        if self.draft is not None:
            self.draft.init_buffers()

