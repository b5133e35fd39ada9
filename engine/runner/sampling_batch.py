"""`SamplingBatch`: one step's sampling inputs on the device, B rows, from a `SamplingPlan` (plain
numbers, the same on every tensor-parallel rank) in one host-to-device copy for the per-row
scalars. The flags (`all_greedy`, `use_top_k`, ...) say which of the sampler's launches a step
needs, known without looking at a tensor (engine/runner/sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request
from engine.runner.sampling_plan import SamplingPlan
from engine.runner.step_inputs import Uploader


@dataclass
class SamplingBatch:
    """Per-step sampling inputs of B rows, on `device`. Token lists are (row, token) pairs so that
    building them needs no vocabulary size."""

    temperatures: torch.Tensor  # [B] float32; 1.0 where the request's temperature is below SAMPLING_EPS
    greedy: torch.Tensor | None  # [B] bool: temperature below SAMPLING_EPS or top_k 1; None when every row is
    top_ks: torch.Tensor | None  # [B] int64; 0 = off; None without top-k (no launch for either)
    top_ps: torch.Tensor  # [B] float32; 1.0 = off
    min_ps: torch.Tensor  # [B] float32; 0.0 = off
    repetition_penalties: torch.Tensor | None  # [B] float32; None when every row is neutral
    frequency_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    seen_pairs: torch.Tensor | None  # [2, S] int64: unique (row, token) in prompt or output
    output_pairs: torch.Tensor | None  # [2, O] int64: unique (row, token) in output
    output_counts: torch.Tensor | None  # [O] float32: occurrences of output_pairs[:, j] in output
    banned_pairs: torch.Tensor | None  # [2, N] int64: (row, token) masked by min_new_tokens
    bias_pairs: torch.Tensor | None  # [2, K] int64: (row, token) with a logit_bias
    bias_values: torch.Tensor | None  # [K] float32: the bias added to logits[bias_pairs]
    # [2, S] int64: the row, then the generator seed, of every sampled (non-greedy) seeded row; None without any
    seed_rows: torch.Tensor | None
    top_logprobs_nums: list[int]  # [B]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    grammar_rows: torch.Tensor | None = None  # [G] int64: rows a grammar constrains ...
    grammar_masks: torch.Tensor | None = None  # [G, ceil(V / 32)] int32: ... bit t set iff token t is allowed

    @classmethod
    def from_requests(
        cls, requests: list[Request], device: torch.device, upload: Uploader | None = None
    ) -> SamplingBatch:
        """The step's sampling inputs (`from_plan` of the requests' plan)."""
        return cls.from_plan(SamplingPlan.from_requests(requests), device, upload)

    @classmethod
    def from_plan(cls, plan: SamplingPlan, device: torch.device, upload: Uploader | None = None) -> SamplingBatch:
        """The plan on the device, sent through `upload` (asynchronous: no host sync). The engine
        passes its own; without one, a fresh `Uploader` (new pinned buffers) serves the call."""
        upload = upload or Uploader(device)
        n = len(plan.top_logprobs_nums)

        def floats(values: list[float] | None) -> torch.Tensor | None:
            return None if values is None else upload.floats([values])[0]

        def pairs(values: list[int] | None) -> torch.Tensor | None:  # [2, N]: row ids, token ids
            return None if values is None else upload([values])[0].view(2, len(values) // 2)

        rows = upload.floats([plan.scalars])[0].view(5, n)  # one host-to-device copy
        return cls(
            temperatures=rows[0],
            greedy=None if plan.all_greedy else rows[1] > 0.5,
            top_ks=rows[2].long() if plan.use_top_k else None,
            top_ps=rows[3],
            min_ps=rows[4],
            repetition_penalties=floats(plan.repetition),
            frequency_penalties=floats(plan.frequency),
            presence_penalties=floats(plan.presence),
            seen_pairs=pairs(plan.seen_pairs),
            output_pairs=pairs(plan.output_pairs),
            output_counts=floats(plan.output_counts),
            banned_pairs=pairs(plan.banned_pairs),
            bias_pairs=pairs(plan.bias_pairs),
            bias_values=floats(plan.bias_values),
            seed_rows=pairs(plan.seed_pairs),
            top_logprobs_nums=plan.top_logprobs_nums,
            all_greedy=plan.all_greedy,
            use_top_k=plan.use_top_k,
            use_top_p=plan.use_top_p,
            use_min_p=plan.use_min_p,
            grammar_rows=None if plan.grammar_rows is None else upload([plan.grammar_rows])[0],
            grammar_masks=None if plan.grammar_masks is None else _masks(plan.grammar_masks, len(plan.grammar_rows or ()), device),
        )

    def __len__(self) -> int:
        return len(self.top_logprobs_nums)


def _masks(data: bytes, rows: int, device: torch.device) -> torch.Tensor:
    """Grammar masks as sent in a plan: [rows, words] int32 on `device`."""
    host = torch.frombuffer(bytearray(data), dtype=torch.int32).view(rows, -1)
    return host.to(device, non_blocking=device.type == "cuda") if host.numel() else host.to(device)
