"""Offline throughput in bench_engine.py: nano-vllm's workload on the engine (section throughput)
and `transformers.generate` on a subsample of it (section hf)."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from bench_runtime import elapsed, say
from device_timing import free_memory, sync

from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import SamplingParams

# ---- 5. throughput ------------------------------------------------------------------------------


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """nano-vllm's bench: random ids in [0, 10000], prompt and output lengths uniform in [lo, hi]."""
    rng = random.Random(args.seed)
    top = min(10000, vocab - 1)
    return [([rng.randint(0, top) for _ in range(rng.randint(args.tp_min_len, args.tp_max_len))],
             rng.randint(args.tp_min_len, args.tp_max_len)) for _ in range(args.tp_requests)]


def throughput(core: EngineCore, args: argparse.Namespace, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    limit = max(30.0, min(args.tp_time_limit_s, args.deadline_s - elapsed() - args.hf_reserve_s))
    expected = sum(n for _, n in work)
    say(f"throughput: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt tokens, {expected} output "
        f"tokens expected; time limit {limit:.0f} s")
    preempt0 = core.scheduler.num_preemptions
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        sp = SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
        err = core.add_request(AddRequest(request_id=f"tp-{i}", prompt_token_ids=prompt, sampling_params=sp))
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")
    tokens, steps, finished, last_print, cut = 0, 0, 0, t0, False
    while core.has_work():
        for d in core.step():
            tokens += len(d.new_token_ids)
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            finished += d.finished
        steps += 1
        now = time.perf_counter()
        if now - last_print > 10:
            say(f"throughput: {now - t0:.0f} s, {tokens} tokens, {finished} finished, "
                f"{core.scheduler.num_running} running, {tokens / (now - t0):.0f} tok/s")
            last_print = now
        if now - t0 > limit:
            say(f"throughput: time limit of {limit:.0f} s reached; aborting the rest (result is partial)")
            core.abort(None)
            cut = True
            break
    wall = time.perf_counter() - t0
    out = {"requests": len(work), "output_tokens": tokens, "expected_output_tokens": expected, "wall_s": wall,
           "steps": steps, "tokens_per_s": tokens / wall, "partial": cut, "temperature": args.temperature,
           "preemptions": core.scheduler.num_preemptions - preempt0}
    say(f"throughput: {tokens} tokens in {wall:.1f} s over {steps} steps = {tokens / wall:.0f} tok/s")
    return out


# ---- 6. transformers ----------------------------------------------------------------------------


def hf_generate(args: argparse.Namespace, work: list[tuple[list[int], int]], device: torch.device) -> dict[str, Any]:
    """`generate` on the first `hf_requests` prompts of the workload, left-padded into one batch,
    exactly `hf_max_new_tokens` greedy tokens each."""
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.bfloat16).to(device).eval()
    prompts = [p for p, _ in work[: args.hf_requests]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    n_new = args.hf_max_new_tokens
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        say(f"hf: generate on {len(prompts)} requests (prompts {min(map(len, prompts))}..{width} tokens, left-padded "
            f"to {width}), {n_new} new tokens each, one batch, greedy, bf16, attn {model.config._attn_implementation}")
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, **kw)
        sync(device)
        wall = time.perf_counter() - t
    generated = (out.shape[1] - width) * out.shape[0]
    if generated != len(prompts) * n_new:
        say(f"hf: WARNING: generated {generated} tokens, expected {len(prompts) * n_new}")
    res = {"requests": len(prompts), "prompt_lens": [len(p) for p in prompts], "padded_width": width,
           "max_new_tokens": n_new, "generated_tokens": generated, "wall_s": wall,
           "tokens_per_s": generated / wall, "step_ms": wall / max(1, out.shape[1] - width) * 1e3,
           "attn_implementation": model.config._attn_implementation, "transformers": transformers.__version__}
    say(f"hf: {generated} tokens in {wall:.1f} s = {generated / wall:.0f} tok/s ({res['step_ms']:.1f} ms per step)")
    del model, out
    free_memory(device)
    return res
