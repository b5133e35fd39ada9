"""The long tail of a rollout batch (bench_serving.py's section longtail, issue 77): a few
sequences with long prompts still generating after the rest of their batch has finished, the
regime that decides when a trainer can start.

    S concurrent /generate requests, one sequence each: P random prompt tokens, O new tokens
    (`--longtail SxPxO`; 8x16384x4096 on a GPU, 2x64x16 in the CPU smoke run), greedy-free
    sampling as the RL sections, `ignore_eos`, logprobs.

Reported: output tok/s in all and per sequence, the mean step time (wall / engine steps, the
prefill steps included: with S long prompts the first steps are prefill), and the server's CPU.
The decode step at those contexts against its roofline is bench_engine.py's (`--decode-contexts`).
"""

from __future__ import annotations

import random
from typing import Any

from serving_clients import random_prompts, rl_specs


def parse_longtail(text: str) -> tuple[int, int, int]:
    """'SxPxO' -> (sequences, prompt tokens, output tokens), each positive."""
    try:
        seqs, prompt, output = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--longtail wants SEQUENCESxPROMPTxOUTPUT, e.g. 8x16384x4096, got {text!r}") from None
    if min(seqs, prompt, output) < 1:
        raise ValueError(f"--longtail: every count must be positive, got {text!r}")
    return seqs, prompt, output


def longtail_specs(text: str, seed: int, vocab: int, sampling: dict[str, Any], procs: int) -> tuple[tuple, dict[str, int]]:
    """The section's requests (rl_specs' singles) and its shape."""
    seqs, prompt, output = parse_longtail(text)
    prompts = random_prompts(random.Random(seed * 104729 + prompt), seqs, prompt, vocab)
    shares = rl_specs("singles", prompts, sampling | {"max_new_tokens": output}, min(procs, seqs))
    return shares, {"sequences": seqs, "prompt_tokens": prompt, "output_tokens_each": output}


def summarize_longtail(r: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """The section's result with its per-sequence rate and mean step time."""
    steps = r.get("engine_steps") or 0
    return r | shape | {"tokens_per_s_per_sequence": r["tokens_per_s"] / shape["sequences"],
                        "mean_step_ms": 1e3 * r["wall_s"] / steps if steps else None}
