"""The mixed step of bench_engine.py (section mixed): what admitting one prompt costs the decodes it
joins. On the decode engine, with B = `--mixed-batch` decodes of the first of `--decode-contexts` tokens and a
chunk of C = `--mixed-chunk` tokens, it times:
  (a) decode: a step of the B running decodes alone;
  (b) chunk: a step that prefills one fresh C-token prompt while nothing else runs;
  (c) mixed: a step of the B decodes plus one fresh C-token prompt, prefilled whole in that step.
ratio = (c) / ((a) + (b)): what one mixed step costs against running its two halves apart.

Every prompt of (b) and (c) is C fresh random token ids (the prefix cache serves none of it; checked)
with max_new_tokens 1, so it finishes in the step that prefills it and never joins the decodes.
The decodes are greedy, ignore_eos, with all the room the context leaves, so they stay B throughout.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from bench_runtime import say
from device_timing import sync
from engine_decode import device_waits

from engine.core.engine_core import EngineCore
from engine.core.protocol import AddRequest
from engine.request import Request, SamplingParams


def mixed_steps(core: EngineCore, args: argparse.Namespace, rng: random.Random, replays: list[int]) -> dict[str, Any]:
    """Section mixed: (b) first, on the idle engine; then B decodes are admitted and prefilled, and
    (a) and (c) alternate, one repetition of each in turn, so both see the same KV lengths."""
    bs, chunk, ctx = args.mixed_batch, args.mixed_chunk, args.decode_context
    sched, device = core.scheduler, core.runner.device
    steps, total = args.mixed_steps_per_rep, args.mixed_warmup + args.mixed_reps
    room = core.max_model_len - ctx  # the decodes' max_new_tokens: all the context leaves
    need = 2 * total * steps + 8  # decode steps they live through, with room for their prefill
    if min(bs, chunk, steps, args.mixed_reps) < 1 or args.mixed_warmup < 0:
        raise RuntimeError("--mixed-batch, --mixed-chunk, --mixed-steps-per-rep and --mixed-reps must be >= 1")
    if sched.max_num_batched_tokens < bs + chunk:
        raise RuntimeError(f"max_num_batched_tokens {sched.max_num_batched_tokens} < {bs} decodes + {chunk}-token "
                           "chunk: the chunk would not be admitted whole")
    if bs + 1 > core.config.max_num_seqs:
        raise RuntimeError(f"{bs} decodes + 1 chunk exceed the engine's max_num_seqs ({core.config.max_num_seqs})")
    if chunk + 1 > core.max_model_len or need > room:
        raise RuntimeError(f"context {core.max_model_len} too short: a {chunk}-token chunk + 1, and {ctx} + {need} "
                           "tokens per decode")
    if sched.has_unfinished():
        core.abort(None)
    preempt0 = sched.num_preemptions
    fresh = _Prompts(rng, core.model_config.vocab_size, chunk)
    busy: dict[str, list[float]] = {"chunk": [], "decode": [], "mixed": []}  # host busy per step, per run
    try:
        chunk_runs = [_timed_run(core, device, steps, fresh, []) for _ in range(total)][args.mixed_warmup:]
        chunk_s, busy["chunk"] = [r[0] for r in chunk_runs], [r[1] for r in chunk_runs]
        decodes = _start_decodes(core, rng, bs, ctx, room)
        decode_s, mixed_s, replayed = [], [], [0, 0]  # decode-graph (a) and piecewise (c) replays in timed steps
        context_start = _mean_context(decodes)
        for rep in range(total):
            r0 = replays[0]
            d = _timed_run(core, device, steps, None, decodes)
            r1 = replays[0], replays[1]
            m = _timed_run(core, device, steps, fresh, decodes)
            if rep >= args.mixed_warmup:
                decode_s.append(d[0])
                mixed_s.append(m[0])
                busy["decode"].append(d[1])
                busy["mixed"].append(m[1])
                replayed = [replayed[0] + r1[0] - r0, replayed[1] + replays[1] - r1[1]]
        context_end = _mean_context(decodes)
        bad = [r.request_id for r in fresh.requests if r.num_cached_tokens or r.num_preemptions]
        if bad or sched.num_preemptions != preempt0:
            raise RuntimeError(f"chunks served by the prefix cache or preempted: {bad[:4]}; "
                               f"{sched.num_preemptions - preempt0} preemptions")
    finally:
        core.abort(None)
    a, b, c = (statistics.median(x) for x in (decode_s, chunk_s, mixed_s))
    out = {
        "batch_size": bs, "chunk_tokens": chunk, "context": ctx, "warmup_reps": args.mixed_warmup,
        "reps": args.mixed_reps, "steps_per_rep": steps, "max_num_batched_tokens": sched.max_num_batched_tokens,
        "decode_step_s": decode_s, "chunk_step_s": chunk_s, "mixed_step_s": mixed_s,
        "decode_step_median_s": a, "chunk_step_median_s": b, "mixed_step_median_s": c,
        "reference_s": a + b, "ratio": c / (a + b),
        "host_busy_median_s": {k: statistics.median(v) for k, v in busy.items()},
        "decode_context_start": context_start, "decode_context_end": context_end,
        "decode_graph_replayed_steps": replayed[0], "mixed_graph_replayed_steps": replayed[1],
        "decode_timed_steps": len(decode_s) * steps,
        "chunks_prefilled": len(fresh.requests),
    }
    say(f"mixed: bs={bs} + {chunk}-token chunk: decode {a * 1e3:.3f} ms, chunk alone {b * 1e3:.3f} ms, mixed "
        f"{c * 1e3:.3f} ms -> mixed / (decode + chunk) = {out['ratio']:.2f}; host busy per step: "
        + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in out["host_busy_median_s"].items())
        + f"; decode graphs replayed in "
        f"{replayed[0]} decode steps and piecewise graphs in {replayed[1]} mixed steps of {len(decode_s) * steps} "
        f"each, context {context_start:.0f}..{context_end:.0f}")
    return out


class _Prompts:
    """Fresh C-token prompts of random ids, one per chunk request; keeps the requests made."""

    def __init__(self, rng: random.Random, vocab: int, length: int) -> None:
        self.rng, self.vocab, self.length = rng, vocab, length
        self.requests: list[Request] = []

    def draw(self, n: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(self.length)] for _ in range(n)]


def _add(core: EngineCore, request_id: str, prompt: list[int], max_new_tokens: int) -> Request:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    err = core.add_request(AddRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    if err is not None:
        raise RuntimeError(f"request {request_id} refused: {err.error}")
    req = core.scheduler.waiting[-1]
    assert req.request_id == request_id
    return req


def _start_decodes(core: EngineCore, rng: random.Random, bs: int, ctx: int, room: int) -> list[Request]:
    """Admit `bs` requests of `ctx` random tokens and step until each has its first token."""
    vocab = core.model_config.vocab_size
    reqs = [_add(core, f"mixed-decode-{i}", [rng.randrange(vocab) for _ in range(ctx)], room) for i in range(bs)]
    waiting, ids = {r.request_id for r in reqs}, {r.request_id for r in reqs}
    for _ in range(10 * bs * ctx):
        for d in core.step():  # with overlap, the first may return the last chunk's delta
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            if d.new_token_ids and d.request_id in ids:
                waiting.discard(d.request_id)
        if not waiting:
            return reqs
    raise RuntimeError("the decodes' prefill does not finish")


def _mean_context(decodes: list[Request]) -> float:
    return sum(r.num_tokens for r in decodes) / len(decodes)


def _timed_run(core: EngineCore, device: torch.device, steps: int, fresh: _Prompts | None,
               decodes: list[Request]) -> tuple[float, float]:
    """(seconds per step, host busy seconds per step) of `steps` consecutive `core.step()` calls:
    host busy is the time inside `core.step()` less its waits for the device (the engine reads
    results through CUDA events), so a run whose host busy is its step time is host-bound. With
    `fresh`, one new prompt is added before each and must be prefilled whole in that very step,
    beside `decodes` (all running, all decoding: checked before and after).

    Timing: the run is timed as a whole, between two device syncs, and divided by its steps. A
    step that overlaps host and device work may return before its device work ends (and return
    the previous step's tokens), so one step timed alone would measure its launch, not its work;
    a run of consecutive steps in steady state measures what each costs, launch and device work
    both, which is also what the decode section's per-step times measure when steps run back to
    back. (a), (b) and (c) are all timed this way, so the ratio compares like with like."""
    sched = core.scheduler
    _check_decoding(sched, decodes)
    prompts = fresh.draw(steps) if fresh is not None else []  # drawn before the clock starts
    sync(device)
    t, inside = time.perf_counter(), 0.0
    with device_waits() as waits:
        for i in range(steps):
            req = _add(core, f"mixed-chunk-{len(fresh.requests)}", prompts[i], 1) if fresh is not None else None
            n0 = core.num_steps
            t_step = time.perf_counter()
            core.step()
            inside += time.perf_counter() - t_step
            # One model step ran, and it computed the whole fresh prompt (computed 0 -> C in it; a
            # budget >= B + C means nothing of the decodes was left out for it). The prefix cache did
            # not serve it: it computed every one of its tokens.
            if core.num_steps != n0 + 1:
                raise RuntimeError(f"core.step() ran {core.num_steps - n0} model steps, not 1")
            if req is not None:
                fresh.requests.append(req)
                if req.num_computed_tokens != fresh.length or req.num_cached_tokens:
                    raise RuntimeError(f"chunk {req.request_id}: {req.num_computed_tokens} of {fresh.length} tokens "
                                       f"computed in its first step ({req.num_cached_tokens} from the prefix cache)")
    sync(device)
    dt = (time.perf_counter() - t) / steps
    _check_decoding(sched, decodes)
    return dt, (inside - sum(waits)) / steps


def _check_decoding(sched: Any, decodes: list[Request]) -> None:
    """Every decode request runs and has one token to compute; nothing else has work left (a
    finished chunk may still be listed while its token is in flight, with nothing to compute)."""
    if sched.num_waiting:
        raise RuntimeError(f"{sched.num_waiting} requests waiting (preemption?)")
    ids = {r.request_id for r in decodes}
    running = {r.request_id for r in sched.running}
    if not ids <= running or any(r.num_tokens - r.num_computed_tokens != 1 for r in decodes):
        raise RuntimeError(f"expected {len(ids)} running decodes, found {len(ids & running)}")
    busy = [r.request_id for r in sched.running
            if r.request_id not in ids and r.num_computed_tokens < r.num_prompt_tokens]
    if busy:
        raise RuntimeError(f"requests other than the decodes still prefilling: {busy[:4]}")
