"""`PromptLogprobs`: the logprobs of prompt tokens a step scores (`logprob_start_len`), and with
`top_logprobs_num` the top alternatives at those positions (SGLang's `input_top_logprobs`, the
prompt part of an OpenAI completion's echo with logprobs).

Rules:
- Prompt token q is scored by the logits of token row q - 1 of the step: log p(token q | < q),
  x - logsumexp(x) in float32, the formula of the sampler's reported logprobs.
- The rows are scored in slices of `ROWS_PER_SLICE`, so a long prefill chunk's [rows, vocab]
  logits never exist whole (8192 rows of a 152k vocabulary would be 5 GB in float32).
- Top alternatives are the `top_k` largest logprobs of the row, best first (ties: torch.topk's
  order); each request keeps the first `top_logprobs_num` of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Token rows scored at once: [ROWS_PER_SLICE, vocab] float32 logits at most.
ROWS_PER_SLICE = 512


@dataclass(frozen=True)
class PromptLogprobs:
    """Per scored row of a step: the prompt token's logprob, and (when the step asks for any)
    its top `top_k` (token id, logprob) pairs."""

    logprobs: list[float]
    tops: list[list[tuple[int, float]]] | None = None

    @staticmethod
    def none() -> PromptLogprobs:
        return PromptLogprobs([])

    @staticmethod
    def score(
        hidden: torch.Tensor, rows: list[int], targets: list[int], top_k: int,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> PromptLogprobs:
        """Score `targets[j]` with the logits of `hidden[rows[j]]` (hidden [T, hidden_size]);
        one host sync per slice."""
        logprobs: list[float] = []
        tops: list[list[tuple[int, float]]] | None = [] if top_k > 0 else None
        for begin in range(0, len(rows), ROWS_PER_SLICE):
            index = torch.tensor(rows[begin : begin + ROWS_PER_SLICE], device=hidden.device)
            target = torch.tensor(targets[begin : begin + ROWS_PER_SLICE], device=hidden.device)
            # x - logsumexp(x), as the sampler reports a generated token's (at temperature 1): a
            # completion re-scored gives the logprobs its generation reported.
            raw = compute_logits(hidden[index])  # [n, vocab], the model dtype, as the sampler gets them
            logits = raw.float()
            lse = _logsumexp(raw)  # [n, 1]
            logprobs += (logits.gather(1, target[:, None]) - lse)[:, 0].tolist()
            if tops is not None:
                values, ids = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)  # [n, k]
                tops += [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), (values - lse).tolist(), strict=True)]
        return PromptLogprobs(logprobs, tops)


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """[n, vocab] in the model dtype -> [n, 1] fp32: on CUDA the sampler's own kernel
    (engine/kernels/lse_argmax.py, temperature 1) on the logits as the sampler gets them, so a
    re-scored token's logprob is its generation's bit for bit (the kernel's sum order follows its
    input dtype: bf16 logits cast to fp32 first sum in another order, one ulp apart, found on an
    H200); else torch's on fp32, the CPU sampler's."""
    if not logits.is_cuda:
        return torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    from engine.kernels.lse_argmax import lse_argmax

    n = logits.shape[0]
    ones = torch.ones(n, dtype=torch.float32, device=logits.device)
    lse, _, _ = lse_argmax(logits, ones, torch.zeros(n, dtype=torch.int32, device=logits.device))
    return lse[:, None]
