"""The sparse mixture-of-experts MLP (Qwen3-MoE's): a router picks each token's top-k experts, each a
SiLU-gated MLP, and sums their outputs weighted by the router's probabilities.

    logits  = gate(x)                                   # [T, E], the model dtype
    weights, ids = top-k of softmax(logits in fp32)     # [T, k] fp32, [T, k]; / their sum if norm_topk_prob
    y[t]    = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
    y[t]   += sigmoid(shared_expert_gate(x[t])) * shared_expert(x[t])     # Qwen2-MoE only

Experts are packed, one tensor per kind (as vLLM's and SGLang's fused MoE read them):
`experts.gate_up_proj` [E, 2I, hidden] (expert e's gate_proj rows, then its up_proj rows) and
`experts.down_proj` [E, hidden, I]. Hugging Face's per-expert names
(`mlp.experts.{e}.gate_proj.weight`, ...) and transformers 5's packed ones
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) land in them (`checkpoint_parts`,
`packed_parts`; engine/weights/loader.py). The router is `gate.weight` [E, hidden].

Qwen2-MoE adds a shared expert: a dense MLP (`shared_expert`, names as any MLP's) that every
token runs, scaled by a sigmoid gate (`shared_expert_gate.weight` [1, hidden]).

Tensor parallelism (vLLM's and SGLang's default for MoE): each rank holds a slice of every
expert's intermediate dimension (gate and up rows each sliced, down's columns sliced; the shared
expert as a dense MLP) and the whole router and shared gate, so every rank routes alike; the
output is this rank's partial sum, which the RMSNorm after the layer all-reduces
(`tp.defers_reduce`: there is no bias), as a dense MLP's. Expert parallelism
(`--enable-expert-parallel`, `tp.whole_experts`): each rank holds E / tp_size whole experts
(`PackedExperts.held`) and sums the pairs routed to them (the kernels take the model's ids and
skip another rank's pairs); the same all-reduce adds the ranks' sums. Another rank's expert
names are validated at their full shape and land nowhere (a shard of length 0), so every rank
checks a whole update.

Devices: a CUDA forward runs the Triton kernels of engine/kernels/moe_routing.py (`topk_softmax`)
and fused_moe.py (`fused_moe`), or for a decode step of few tokens in half precision the router's
GEMV and top-k in one launch (moe_router.py `router_topk`), imported on first use, so a CPU forward never imports Triton; any
other device runs this file's torch code, the reference the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models.layers import MLP
from engine.models.linear import Linear
from engine.models.routed_experts import RoutedExperts
from engine.parallel import Shard, TensorParallel

if TYPE_CHECKING:
    from engine.kernels.moe_workspace import MoeWorkspace


def sparse_layers(config: ModelConfig) -> tuple[int, ...]:
    """The layers whose MLP is the mixture of experts: layer i unless listed in
    `mlp_only_layers`, and only when (i + 1) % decoder_sparse_step == 0 (transformers', vLLM's
    and SGLang's rule for Qwen2-MoE and Qwen3-MoE)."""
    if config.num_experts < 1:
        return ()
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
    return tuple(i for i in range(config.num_layers) if i not in dense and (i + 1) % step == 0)


def route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, ids [T, k] int64), highest weight first:
    softmax over the experts in fp32, its top k, divided by their sum when `renormalize`. Among
    equal probabilities the lower expert id comes first (a stable sort, as the CUDA kernel;
    torch.topk, which transformers uses, promises no order among ties)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :k], ids[:, :k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def reference_moe(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear, first: int = 0,
) -> torch.Tensor:
    """x [T, hidden], gate_up [E, 2I, hidden], down [E, hidden, I], weights / ids [T, k] ->
    [T, hidden]. Each expert that any token routes to runs once, on its tokens; the weighted
    outputs are summed per token in the model dtype (as transformers does). The tensors hold
    experts first .. first + E - 1; pairs routed to others add nothing (expert parallelism)."""
    T, k = ids.shape
    E = gate_up.shape[0]
    out = torch.zeros_like(x)
    flat = ids.reshape(-1) - first
    flat = torch.where((flat >= 0) & (flat < E), flat, E)  # another rank's expert: a bucket past the last
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=E + 1).tolist()[:E]
    w = weights.reshape(-1, 1).to(x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        gate, up = linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        out.index_add_(0, tokens, linear(F.silu(gate) * up, down[e]) * w[pairs])
    return out


@dataclass(frozen=True)
class ExpertSlot:
    """Where (part of) one checkpoint tensor lands: `param[index]` of the packed experts, of
    which this rank holds `shard` of the checkpoint tensor (None: all of it)."""

    param: str  # "gate_up_proj" | "down_proj"
    index: tuple[int | slice, ...]
    shard: Shard | None


class PackedExperts(nn.Module):
    """Experts `held` of the model's E, SiLU-gated MLPs in two tensors: gate_up_proj [E_r, 2 I_r,
    hidden], down_proj [E_r, hidden, I_r]. Tensor parallelism: all E experts, I_r this rank's
    slice of moe_intermediate_size (`shard`); expert parallelism: E / tp_size whole experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_experts = num_experts  # the model's, routed over by every rank
        if tp.whole_experts:
            self.held = tp.even(num_experts, f"num_experts ({num_experts})")
            self.shard = Shard(0, 0, intermediate_size, intermediate_size)
        else:
            self.held = Shard(0, 0, num_experts, num_experts)
            self.shard = tp.even(intermediate_size, f"moe_intermediate_size ({intermediate_size})")
        part, local = self.shard.length, self.held.length
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * part, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, part), requires_grad=False)

    @property
    def first(self) -> int | None:
        """The model's id of this rank's first expert with expert parallelism (the fused kernels'
        `first`); None where it holds every expert."""
        return None if self.held.whole else self.held.start

    def checkpoint_parts(self) -> dict[str, ExpertSlot]:
        """Hugging Face's per-expert names (below this module) -> where each lands, expert by
        expert in checkpoint order. Another rank's expert lands nowhere: a shard of length 0."""
        s, part, held = self.shard, self.shard.length, self.held
        rows = None if s.whole else s  # of gate_proj / up_proj [I, hidden]
        cols = None if s.whole else Shard(1, s.start, s.length, s.total)  # of down_proj [hidden, I]
        no_rows = ExpertSlot("gate_up_proj", (0, slice(0, 0)), Shard(0, 0, 0, s.total))  # another rank's
        no_cols = ExpertSlot("down_proj", (0, slice(None), slice(0, 0)), Shard(1, 0, 0, s.total))
        parts: dict[str, ExpertSlot] = {}
        for e in range(self.num_experts):
            i = e - held.start
            mine = 0 <= i < held.length
            parts[f"{e}.gate_proj.weight"] = ExpertSlot("gate_up_proj", (i, slice(0, part)), rows) if mine else no_rows
            parts[f"{e}.up_proj.weight"] = ExpertSlot("gate_up_proj", (i, slice(part, 2 * part)), rows) if mine else no_rows
            parts[f"{e}.down_proj.weight"] = ExpertSlot("down_proj", (i,), cols) if mine else no_cols
        return parts

    def packed_parts(self) -> dict[str, tuple[ExpertSlot, ...]]:
        """transformers 5's packed names (below this module; gate_up_proj [E, 2I, hidden], down_proj
        [E, hidden, I]) -> where their parts land: the whole parameter on one rank; the rank's
        experts (dim 0) with expert parallelism; else the rank's gate rows and up rows of the
        packed gate_up, and its columns of down."""
        s, part, held = self.shard, self.shard.length, self.held
        if not held.whole:
            return {"gate_up_proj": (ExpertSlot("gate_up_proj", (), held),), "down_proj": (ExpertSlot("down_proj", (), held),)}
        if s.whole:
            return {"gate_up_proj": (ExpertSlot("gate_up_proj", (), None),), "down_proj": (ExpertSlot("down_proj", (), None),)}
        total = 2 * s.total
        gate = ExpertSlot("gate_up_proj", (slice(None), slice(0, part)), Shard(1, s.start, part, total))
        up = ExpertSlot("gate_up_proj", (slice(None), slice(part, 2 * part)), Shard(1, s.total + s.start, part, total))
        down = ExpertSlot("down_proj", (), Shard(2, s.start, part, s.total))
        return {"gate_up_proj": (gate, up), "down_proj": (down,)}

    linear_fn = staticmethod(F.linear)  # torch's, or models/invariant.py's (`--deterministic`)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch reference (`reference_moe`) over these experts."""
        return reference_moe(x, self.gate_up_proj, self.down_proj, weights, ids, self.linear_fn, self.held.start)


class SparseMoE(nn.Module):
    """The MoE MLP of decoder layer `layer_id`: x [T, hidden] -> [T, hidden] (at tp > 1 this
    rank's partial sum). `routed` (attached by the model, `RoutedExperts`): where each forward
    records the layer's top-k ids; None records nothing. On CUDA the kernels run whatever `fused`
    says (the torch reference syncs with the host per expert, so no graph could hold it); `fused`
    only lets the router's linear run the few-rows GEMV. `kernels` False (models/invariant.py,
    `--deterministic`): the torch reference on CUDA too, its matmuls the invariant ones and a
    token's experts added in expert order, eagerly."""

    kernels = True

    def __init__(self, config: ModelConfig, layer_id: int, fused: bool, tp: TensorParallel) -> None:
        super().__init__()
        E, k = config.num_experts, config.num_experts_per_tok
        if not 0 < k <= E:
            raise ConfigError(f"num_experts_per_tok ({k}) must be in [1, num_experts ({E})]")
        if config.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be >= 1, got {config.moe_intermediate_size}")
        self.layer_id = layer_id
        self.top_k = k
        self.renormalize = config.norm_topk_prob
        # Registered in transformers 5's order (experts, then the router), so that a trainer's
        # flattened bucket of its packed names lies in the weights region as one span.
        self.experts = PackedExperts(E, config.hidden_size, config.moe_intermediate_size, tp)
        self.gate = Linear(config.hidden_size, E, bias=False, fused=fused)  # replicated on every rank
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size, False, fused, tp)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)  # replicated; one row: no GEMV kernel
        self.routed: RoutedExperts | None = None

    def reserve(self, max_tokens: int) -> MoeWorkspace:
        """CUDA: the fused kernels' shared workspace for this layer's shapes and steps of up to
        `max_tokens` tokens, allocated now if it is not yet (engine/kernels/moe_workspace.py)."""
        from engine.kernels.fused_moe import workspace_for

        return workspace_for(max_tokens, self.experts.down_proj, self.top_k, self.experts.first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        out = self._routed(x)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]: the experts' sum
        if x.is_cuda and self.kernels:
            from engine.kernels import moe_router
            from engine.kernels.fused_moe import fused_moe
            from engine.kernels.moe_routing import topk_softmax
            from engine.kernels.moe_tiles import pair_tiles_apply

            E, T, held = self.experts.num_experts, x.shape[0], self.experts.held
            # The one-launch router keeps its logits in the experts' workspace, sized for all E.
            if held.whole and self.gate.fused and moe_router.applies(x, E) and pair_tiles_apply(T * self.top_k, E):
                ws = self.reserve(T)  # the shared workspace: its router scratch
                # Right after the post-attention norm: PDL and the router's weight prefetched into L2.
                weights, ids = moe_router.router_topk(x, self.gate.weight, self.top_k, self.renormalize, ws, prefetch=True)
            else:
                logits = self.gate(x)  # [T, E] in the model dtype, as transformers computes them
                weights, ids = topk_softmax(logits, self.top_k, self.renormalize)  # fp32, int32
            if self.routed is not None:
                self.routed.record(self.layer_id, ids)
            # expert parallelism: the kernels skip another rank's pairs
            return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids, first=self.experts.first)
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.routed is not None:
            self.routed.record(self.layer_id, ids)
        return self.experts(x, weights, ids)
