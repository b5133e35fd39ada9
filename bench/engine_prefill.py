"""bench_engine.py's section prefill (mixture-of-experts shapes): N fresh prompts of L tokens
prefilled by the decode engine, as achieved TFLOP/s against the dense bf16 matmul rate measured
in the same run.

Rules:
- Workload: N = `--prefill-seqs` prompts (64) of L = `--prefill-len` random ids (2048), each
  max_new_tokens 1, all added at once; the scheduler packs them into steps of up to
  max_num_batched_tokens tokens (`--max-num-batched-tokens`; the engine's default 8192: four
  2048-token prompts a step), chunking a prompt where a step's budget ends. Timed from before the
  first step to the last prompt's token, between two device syncs. An untimed warm-up of
  `--prefill-warmup-seqs` prompts first (default: one full step, at most N) keeps compiles out. No prompt is
  served by the prefix cache and nothing is preempted (both checked).
- FLOPs (2 per multiply-add), what the model computes, counted from its config:
    per token:  2 x (q, k, v and o projections; per sparse layer the router [E, hidden] and k
                experts' gate, up and down [I, hidden] each; per dense layer its MLP, 3 x hidden x
                intermediate)
    per prompt and layer: 2 x 2 x heads x head_dim x L (L + 1) / 2 (causal QK^T and P V)
    per prompt: 2 x hidden x vocab (the one row's logits)
  Norms, rope, softmax, SiLU and the embedding lookup are left out.
- Reference: the dense bf16 rate of one [T k, hidden] x [hidden, 3 moe_intermediate] matmul,
  T = max_num_batched_tokens (device_timing.matmul_tflops): the rate a grouped GEMM of a full
  step's T k (token, expert) pairs could reach (bench/kernels/moe.py's reference). Target: the
  achieved rate >= 0.35 of it.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from bench_runtime import say
from device_timing import matmul_tflops, sync

from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import Request, SamplingParams


def prefill_flops(core: EngineCore, num_prompts: int, length: int) -> dict[str, float]:
    """The FLOPs of prefilling `num_prompts` prompts of `length` tokens (the module's count),
    split into linear layers, attention scores and logits."""
    mc = core.model_config
    h, hd = mc.hidden_size, mc.head_dim
    sparse = {m.layer_id for m in core.runner.model.sparse_layers()}
    attn = h * mc.num_heads * hd * 2 + h * mc.num_kv_heads * hd * 2  # q and o; k and v
    moe = h * mc.num_experts + mc.num_experts_per_tok * 3 * h * mc.moe_intermediate_size  # router, k experts
    dense = 3 * h * mc.intermediate_size
    per_token = sum(attn + (moe if i in sparse else dense) for i in range(mc.num_layers))
    tokens = num_prompts * length
    linear = 2 * tokens * per_token
    scores = num_prompts * mc.num_layers * 2 * 2 * mc.num_heads * hd * length * (length + 1) / 2
    logits = num_prompts * 2 * h * mc.vocab_size
    return {"active_params_per_token": per_token, "linear_flops": linear, "attention_score_flops": scores,
            "logits_flops": logits, "total_flops": linear + scores + logits}


def prefill_steps(core: EngineCore, args: argparse.Namespace, rng: random.Random, replays: list[int]) -> dict[str, Any]:
    n, length = args.prefill_seqs, args.prefill_len
    budget = core.scheduler.max_num_batched_tokens
    if length + 1 > core.max_model_len:
        raise RuntimeError(f"context {core.max_model_len} too short for {length}-token prompts and their token")
    if core.scheduler.has_unfinished():
        core.abort(None)
    warm = args.prefill_warmup_seqs if args.prefill_warmup_seqs is not None else min(n, -(-budget // length))
    vocab = core.model_config.vocab_size
    if warm:
        _run(core, [[rng.randrange(vocab) for _ in range(length)] for _ in range(warm)], "prefill-warm")
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]  # drawn before the clock starts
    preempt0, steps0, piece0 = core.scheduler.num_preemptions, core.num_steps, replays[1]
    seconds, reqs = _run(core, prompts, "prefill")
    steps, piecewise = core.num_steps - steps0, replays[1] - piece0
    cached = sum(r.num_cached_tokens for r in reqs)
    if cached or core.scheduler.num_preemptions != preempt0:
        raise RuntimeError(f"{cached} prompt tokens from the prefix cache, "
                           f"{core.scheduler.num_preemptions - preempt0} preemptions: not a clean prefill")
    flops = prefill_flops(core, n, length)
    mc = core.model_config
    rows = budget * mc.num_experts_per_tok
    dense = matmul_tflops(rows, mc.hidden_size, 3 * mc.moe_intermediate_size, core.runner.device)
    tflops = flops["total_flops"] / seconds / 1e12
    out = {"prompts": n, "prompt_len": length, "tokens": n * length, "warmup_prompts": warm, "seconds": seconds,
           "steps": steps, "piecewise_graph_steps": piecewise, "max_num_batched_tokens": budget,
           "tokens_per_s": n * length / seconds, "tflops": tflops, "dense_matmul_rows": rows,
           "dense_matmul_shape": [rows, mc.hidden_size, 3 * mc.moe_intermediate_size], "dense_tflops": dense,
           "dense_ratio": tflops / dense} | flops  # fmt: skip
    say(f"prefill: {n} x {length} tokens in {seconds:.3f} s ({steps} steps of <= {budget} tokens, {piecewise} from "
        f"piecewise graphs): {flops['total_flops'] / 1e12:.1f} TFLOP -> {tflops:.1f} TFLOP/s; dense bf16 matmul "
        f"[{rows} x {mc.hidden_size}] x [{mc.hidden_size} x {3 * mc.moe_intermediate_size}] {dense:.1f} TFLOP/s "
        f"-> {out['dense_ratio']:.3f} of it")
    return out


def _run(core: EngineCore, prompts: list[list[int]], name: str) -> tuple[float, list[Request]]:
    """Add every prompt (max_new_tokens 1) and step until each has its token: (seconds from the
    first step to the last token, between device syncs; the requests)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    reqs = []
    for i, prompt in enumerate(prompts):
        err = core.add_request(AddRequest(request_id=f"{name}-{i}", prompt_token_ids=prompt, sampling_params=params))
        if err is not None:
            raise RuntimeError(f"request {name}-{i} refused: {err.error}")
        reqs.append(core.scheduler.waiting[-1])
    waiting = {r.request_id for r in reqs}
    device = core.runner.device
    sync(device)
    t = time.perf_counter()
    for _ in range(10 * sum(map(len, prompts))):
        for d in core.step():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            if d.new_token_ids:
                waiting.discard(d.request_id)
        if not waiting:
            break
    else:
        raise RuntimeError(f"{name}: the prefill does not finish")
    sync(device)
    return time.perf_counter() - t, reqs
