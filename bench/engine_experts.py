"""The decode roofline of a mixture-of-experts model in bench_engine.py (section decode): the weight
bytes one decode step reads, with the experts counted from the routes the step's tokens took.

Rules:
- A decode step reads once every weight that is not an expert (attention, norms, routers, the
  lm_head, a dense MLP of mlp_only_layers), of an untied input embedding only its batch's rows,
  and of each sparse layer l only the E_l distinct experts its tokens route to, each expert's
  gate_up [2I, hidden] and down [hidden, I] (3 hidden I elements; bf16: 2 bytes each).
- E_l is measured, not assumed: the engine records routes (EngineConfig
  enable_return_routed_experts), and its RoutedExperts buffer holds the last forward's ids
  [tokens, layers, k] (rows 0..bs-1 are the batch's, replayed graphs included). After the timed
  steps, `steps` more decode steps run, each followed by a device sync and a read of the buffer:
  no read and no sync lands in a timed step. The step's bytes are the mean over those steps.
- What the engine pays to record routes (one copy of the [bs, k] ids per sparse layer, inside the
  decode graphs, and one small copy to the host per step) is part of every timed step.
"""

from __future__ import annotations

from typing import Any

import torch
from device_timing import sync
from engine_decode import decode_weight_bytes

from engine.core.engine_core import EngineCore


class ExpertBytes:
    """The bytes of one engine's model, split into what every decode step reads and the experts
    of each sparse layer; `measure` counts the experts a batch's steps read."""

    def __init__(self, core: EngineCore) -> None:
        model = core.runner.model
        sparse = model.sparse_layers()
        if not sparse:
            raise RuntimeError("the model has no mixture-of-experts layers")
        self.layer_ids = [m.layer_id for m in sparse]
        self.num_experts = sparse[0].experts.num_experts
        # Bytes of one expert of each sparse layer: its share of the packed gate_up and down.
        self.per_expert = [sum(p.numel() * p.element_size() for p in m.experts.parameters()) // self.num_experts
                           for m in sparse]
        self.experts_total = self.num_experts * sum(self.per_expert)
        self.other_bytes = decode_weight_bytes(core) - self.experts_total  # an untied embedding left out too
        embed = model.model.embed_tokens.weight
        self.embed_row_bytes = 0 if core.model_config.tie_word_embeddings else embed.shape[1] * embed.element_size()

    def summary(self) -> dict[str, Any]:
        return {"non_expert_bytes": self.other_bytes, "expert_bytes_all": self.experts_total,
                "bytes_per_expert": self.per_expert[0], "sparse_layers": len(self.layer_ids),
                "num_experts": self.num_experts, "embedding_row_bytes": self.embed_row_bytes}

    def measure(self, core: EngineCore, bs: int, steps: int) -> dict[str, Any]:
        """Run `steps` untimed decode steps of the `bs` running requests, each read back after a
        sync: the distinct experts of each sparse layer per step, and the weight bytes a step reads."""
        routed = core.runner.routed
        if routed is None:
            raise RuntimeError("the engine records no routes (build it with enable_return_routed_experts=True)")
        if steps < 1:
            raise RuntimeError("--moe-route-steps must be >= 1 for an MoE shape")
        layers = torch.tensor(self.layer_ids, device=routed.buffer.device)
        counts: list[list[int]] = []  # [step][sparse layer] distinct experts
        for _ in range(steps):
            if len(core.scheduler.running) != bs or core.scheduler.num_waiting:
                raise RuntimeError(f"expected {bs} running requests while counting experts (preemption?)")
            core.step()  # launches one step of the bs decodes (and, with overlap, reads the one before)
            sync(core.runner.device)
            ids = routed.last(bs).index_select(1, layers).long()  # [bs, L, k] of the step just run
            seen = torch.zeros(len(self.layer_ids), self.num_experts, dtype=torch.bool, device=ids.device)
            seen.scatter_(1, ids.transpose(0, 1).reshape(len(self.layer_ids), -1), True)
            counts.append(seen.sum(dim=1).tolist())
        expert_bytes = sum(n * b for step in counts for n, b in zip(step, self.per_expert, strict=True)) / steps
        per_layer = [sum(step) / len(step) for step in counts]
        weight_bytes = self.other_bytes + bs * self.embed_row_bytes + expert_bytes
        return {"route_steps": steps, "distinct_experts_per_layer": sum(per_layer) / steps,
                "distinct_experts_min": min(min(s) for s in counts), "distinct_experts_max": max(max(s) for s in counts),
                "distinct_experts_per_step": per_layer, "expert_bytes_read": expert_bytes,
                "non_expert_bytes_read": self.other_bytes + bs * self.embed_row_bytes,
                "weight_bytes_read": weight_bytes}
