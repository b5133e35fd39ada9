"""`SamplingPlan`: one step's sampling inputs as plain numbers, built on the host from the requests
that sample. It is what crosses to the other tensor-parallel ranks (every rank samples the same
logits with the same generators, so all hold the same tokens: the next step's inputs take them
from the device), and what `SamplingBatch.from_plan` (sampler.py) sends to the device in a few
asynchronous copies. Token lists are (row, token) pairs, rows first then tokens, so that building
them needs no vocabulary size.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from engine.request import Request
from engine.runner.grammar import fill_masks

# A seeded row's noise at output step n comes from a generator seeded with
# (seed * _SEED_STRIDE + n) & _SEED_MASK: the same for that (seed, n) whatever else is batched
# with it, and again after a preemption recomputes the row.
_SEED_STRIDE = 1_000_003
_SEED_MASK = (1 << 63) - 1


def step_seed(seed: int, num_output_tokens: int) -> int:
    """Generator seed of a seeded request when it samples its output token `num_output_tokens`."""
    return (seed * _SEED_STRIDE + num_output_tokens) & _SEED_MASK


class SamplingPlan(msgspec.Struct, array_like=True):
    """B rows. `scalars` is [5, B] row-major: temperature (1.0 for greedy), greedy (0/1), top_k
    (0 = off), top_p, min_p. Optional parts are None when no row needs them."""

    scalars: list[float]
    repetition: list[float] | None  # [B]
    frequency: list[float] | None  # [B]
    presence: list[float] | None  # [B]
    seen_pairs: list[int] | None  # (row, token) unique in prompt + output, for repetition
    output_pairs: list[int] | None  # (row, token) unique in output ...
    output_counts: list[float] | None  # ... and how often each occurs
    banned_pairs: list[int] | None  # (row, token) masked by min_new_tokens
    bias_pairs: list[int] | None  # (row, token) with a logit_bias ...
    bias_values: list[float] | None  # ... and the bias
    seed_pairs: list[int] | None  # (row, generator seed) of every sampled (non-greedy) seeded row
    top_logprobs_nums: list[int]  # [B]
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    grammar_rows: list[int] | None = None  # rows constrained by a grammar (engine/runner/grammar.py) ...
    grammar_masks: bytes | None = None  # ... and their masks: [rows, words] int32, little-endian

    @property
    def leaves_logits(self) -> bool:
        """No penalty, bias, ban or grammar changes the logits (`Sampler.process_logits` returns
        them as they are)."""
        return (self.repetition is None and self.output_pairs is None and self.bias_pairs is None
                and self.banned_pairs is None and self.grammar_rows is None)  # fmt: skip

    @classmethod
    def from_requests(cls, requests: list[Request], offsets: list[int] | None = None) -> SamplingPlan:
        """One row per entry of `requests`; `offsets[j]`: row j samples its request's output token
        num_output_tokens + offsets[j] (a draft's position under speculative decoding; default 0)."""
        params = [r.sampling_params for r in requests]
        def out(i: int) -> int:  # the output index row i samples
            return requests[i].num_output_tokens + (offsets[i] if offsets else 0)

        # The fixed entries, one column each (SamplingParams.plan_row; top_k 0 when off, so > 1 is "on").
        columns = zip(*(p.plan_row for p in params), strict=True) if params else [()] * 9
        temps, greedy, top_k, top_p, min_p, rep, freq, pres, top_n = columns
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
        seeds = [step_seed(params[i].seed, out(i)) for i in seeded]  # type: ignore[arg-type]
        use_rep = any(x != 1.0 for x in rep)
        use_out = any(x != 0.0 for x in freq) or any(x != 0.0 for x in pres)
        seen = outputs = counts = None
        if use_rep:
            rows, cols = [], []
            for i, r in enumerate(requests):
                if rep[i] != 1.0:
                    tokens = set(r.token_ids)
                    rows += [i] * len(tokens)
                    cols += tokens
            seen = rows + cols
        if use_out:
            rows, cols, counts = [], [], []
            for i, r in enumerate(requests):
                if freq[i] != 0.0 or pres[i] != 0.0:
                    counter = Counter(r.output_token_ids)
                    rows += [i] * len(counter)
                    cols += counter.keys()
                    counts += map(float, counter.values())
            outputs = rows + cols

        # min_new_tokens: the tokens that would end the request are impossible until it has enough.
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, (r, p) in enumerate(zip(requests, params, strict=True)):
            if p.min_new_tokens and out(i) < p.min_new_tokens:
                ended_by = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                ban_rows += [i] * len(ended_by)
                ban_cols += ended_by
        bias_rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
        bias = [pair for p in params for pair in p.logit_bias]
        sampled = [g == 0.0 for g in greedy]
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        return cls(
            scalars=[*temps, *greedy, *top_k, *top_p, *min_p],  # top_k < 2**24 is exact in float32
            repetition=list(rep) if use_rep else None,
            frequency=list(freq) if use_out else None,
            presence=list(pres) if use_out else None,
            seen_pairs=seen,
            output_pairs=outputs,
            output_counts=counts,
            banned_pairs=ban_rows + ban_cols if ban_rows else None,
            bias_pairs=bias_rows + [t for t, _ in bias] if bias else None,
            bias_values=[b for _, b in bias] if bias else None,
            seed_pairs=seeded + seeds if seeded else None,
            top_logprobs_nums=list(top_n),
            all_greedy=not any(sampled),
            use_top_k=any(k > 1 and s for k, s in zip(top_k, sampled, strict=True)),
            use_top_p=any(p < 1.0 and s for p, s in zip(top_p, sampled, strict=True)),
            use_min_p=any(m > 0.0 and s for m, s in zip(min_p, sampled, strict=True)),
            grammar_rows=grammar_rows or None,
            grammar_masks=fill_masks([requests[i].grammar for i in grammar_rows]) if grammar_rows else None,
        )
