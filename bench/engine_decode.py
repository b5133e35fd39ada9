"""bench_engine.py's section decode: the weight bytes a decode step reads, and the decode step
time at one batch size against the roofline (the copy bandwidth is device_timing.copy_bandwidth).
A mixture of experts reads only the experts its tokens route to: `routes` (engine_experts.py)
counts them after the timed steps and gives the step's weight bytes."""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from bench_runtime import say

from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import SamplingParams


def decode_weight_bytes(core: EngineCore) -> int:
    """Weight bytes one decode step reads: every parameter once (a tied embedding is one
    parameter), less an untied input embedding, of which a step reads only its batch's rows."""
    model = core.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if core.model_config.tie_word_embeddings:
        return total
    embed = model.model.embed_tokens.weight
    return total - embed.numel() * embed.element_size()


@contextlib.contextmanager
def device_waits() -> Iterator[list[float]]:
    """Seconds the host spends blocked in torch.cuda.Event.synchronize, one entry per call: a
    decode step's waits for the device (the engine reads each step's results through one)."""
    waits: list[float] = []
    original = torch.cuda.Event.synchronize

    def timed(event: torch.cuda.Event) -> None:
        t = time.perf_counter()
        original(event)
        waits.append(time.perf_counter() - t)

    torch.cuda.Event.synchronize = timed  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]


def decode_new_tokens(args: argparse.Namespace) -> int:
    """Tokens each decode sequence may generate: the warm-up and timed steps, with room to spare."""
    return 4 * (args.decode_steps + args.decode_warmup) + 64


def decode_steps(core: EngineCore, args: argparse.Namespace, bs: int, rng: random.Random,
                 weight_bytes: int, kv_token_bytes: int, bandwidth: float | None, replays: list[int],
                 routes: Callable[[EngineCore, int], dict[str, Any]] | None = None, context: int | None = None,
                 ) -> dict[str, Any]:  # fmt: skip
    """Step time of `bs` sequences decoding after `context` prompt tokens each (args.decode_context)."""
    if bs > core.config.max_num_seqs:
        raise RuntimeError(f"batch {bs} is more than the engine's max_num_seqs ({core.config.max_num_seqs})")
    context = args.decode_context if context is None else context
    vocab = core.model_config.vocab_size
    new_tokens = min(args.max_model_len - context, decode_new_tokens(args))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        err = core.add_request(AddRequest(request_id=f"decode-{bs}-{i}", prompt_token_ids=prompt, sampling_params=params))
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")
    preempt0 = core.scheduler.num_preemptions
    t = time.perf_counter()
    started: set[str] = set()
    prefill_steps = 0
    while len(started) < bs:  # until every request has its first token: all of them decode now
        for d in core.step():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            if d.new_token_ids:
                started.add(d.request_id)
        prefill_steps += 1
        if prefill_steps > 10 * bs * context:
            raise RuntimeError("prefill does not finish")
    prefill_s = time.perf_counter() - t
    for _ in range(args.decode_warmup):
        core.step()
    replays0 = replays[0]
    times, kv_tokens = [], []
    with device_waits() as waits:
        for _ in range(args.decode_steps):
            running = core.scheduler.running
            if len(running) != bs or core.scheduler.num_waiting:
                raise RuntimeError(f"expected {bs} running requests, found {len(running)} (preemption?)")
            kv_tokens.append(sum(r.num_tokens for r in running))  # KV positions each sequence reads
            t = time.perf_counter()
            deltas = core.step()
            times.append(time.perf_counter() - t)
            if sum(len(d.new_token_ids) for d in deltas) != bs:
                raise RuntimeError(f"a decode step at batch {bs} produced {len(deltas)} deltas")
    host_busy_s = (sum(times) - sum(waits)) / len(times)
    graph_steps = replays[0] - replays0
    experts = routes(core, bs) if routes is not None else {}  # untimed steps of their own, after the timed ones
    weight_bytes = experts.get("weight_bytes_read", weight_bytes)
    core.abort(None)
    mean_s = sum(times) / len(times)
    kv_bytes = kv_token_bytes * sum(kv_tokens) / len(kv_tokens)
    roofline_s = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None  # None: no roofline asked for
    out = {
        "batch_size": bs, "context": context, "prefill_steps": prefill_steps, "prefill_s": prefill_s,
        "steps": len(times), "step_mean_s": mean_s, "step_median_s": statistics.median(times),
        "step_min_s": min(times), "step_max_s": max(times), "graph_replayed_steps": graph_steps,
        "mean_kv_tokens_read": sum(kv_tokens) / len(kv_tokens), "kv_bytes_read": kv_bytes,
        "weight_bytes_read": weight_bytes, "roofline_s": roofline_s,
        "measured_over_roofline": mean_s / roofline_s if roofline_s else None,
        "roofline_bandwidth_fraction": roofline_s / mean_s if roofline_s else None,
        "preemptions": core.scheduler.num_preemptions - preempt0,
        "host_busy_mean_s": host_busy_s,  # the step minus its waits for the device
    } | experts
    roof = f"roofline {roofline_s * 1e3:.3f} ms, measured/roofline {out['measured_over_roofline']:.2f}, " if roofline_s else ""
    if experts:
        roof += f"{experts['distinct_experts_per_layer']:.1f} distinct experts per layer, "
    say(f"decode bs={bs} context={context}: step {mean_s * 1e3:.3f} ms (median {out['step_median_s'] * 1e3:.3f}), {roof}"
        f"{graph_steps}/{len(times)} steps from CUDA graphs, host busy {host_busy_s * 1e3:.3f} ms per step, "
        f"prefill {prefill_s:.2f} s in {prefill_steps} steps")
    return out
