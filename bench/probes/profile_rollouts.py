"""Where the device time of an RL rollout round goes: torch.profiler over one round of bench_deterministic's
RL shape (N prompts of P random tokens, O sampled tokens each with logprobs) on an in-process EngineCore,
after an untimed round and a timed one. Prints the kernels grouped by name (ms in the round, launches, share),
the round's wall time and tok/s, the sum of its kernels' time, and the device's idle gaps between kernels by
the pair of kernels around them (device_timing.idle_gaps); run it once per mode to compare.
Then one more round with the device synchronized after every step, its wall time by the kind of step
launched (decode: one token a row; prefill: any row with more): the steps where a mode's cost lies.
`--cprofile K`: one more round under cProfile, its K functions of most own time (the host's share).
Every round also names the Triton kernels compiled (or loaded from the disk cache) while it ran: a
compile inside a timed round is host time no graph hides.
`--host-phases`: one more round with the host's time and calls by phase of EngineCore.step (`phases_round`'s
list: schedule, plan, graph replay, sampling inputs and their uploads, pinned buffers and event waits, the
sampler's launch, the read of a step's tokens and the wait for them, applying them).
Every round runs with the startup heap frozen, as the engine process runs (bench_runtime.engine_process_heap).

    python3 bench/probes/profile_rollouts.py --shape 8b --out $OUT/roll.json
    python3 bench/probes/profile_rollouts.py --shape 8b --deterministic --out $OUT/roll_det.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import engine_process_heap, say, write_json  # noqa: E402
from device_timing import device_events, idle_gaps, kernel_times  # noqa: E402
from engine_shapes import checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.protocol import AddRequest  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def add_round(core: EngineCore, tag: str, shape: tuple[int, int, int], rng: random.Random) -> None:
    """A round's requests: N fresh prompts of P random tokens, each sampling O tokens with logprobs."""
    n, prompt_len, out_len = shape
    vocab = core.model_config.vocab_size
    params = SamplingParams(max_new_tokens=out_len, temperature=1.0, ignore_eos=True, logprobs=True)
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        assert core.add_request(AddRequest(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling_params=params)) is None


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[tuple[str, float]]]:
    """While open, every variant Triton's JIT path builds (compiles, or loads from its disk
    cache): (kernel name, seconds), appended in order. Through Triton's own hooks around a build
    (`knobs.runtime.jit_cache_hook` before, `jit_post_compile_hook` after)."""
    from triton import knobs

    seen: list[tuple[str, float]] = []
    building: list[tuple[str, float]] = []

    def before(**kw: Any) -> None:
        building.append((kw["fn"].name, time.perf_counter()))  # None: build it

    def after(**kw: Any) -> None:
        name, t0 = building.pop()
        seen.append((name, time.perf_counter() - t0))

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def compiles_since(seen: list[tuple[str, float]], start: int) -> str:
    """The compiles after index `start`, as one line: count, seconds and the kernels by count."""
    new = seen[start:]
    names = Counter(name for name, _ in new)
    return f"{len(new)} compiles, {sum(s for _, s in new):.2f} s" + (f" ({', '.join(f'{n} x{c}' for n, c in names.most_common(6))})" if new else "")


def rollout_round(core: EngineCore, tag: str, shape: tuple[int, int, int], rng: random.Random) -> tuple[int, float]:
    """One round of fresh prompts run to the end: (engine steps, wall seconds)."""
    add_round(core, tag, shape, rng)
    steps, t0 = 0, time.perf_counter()
    for _ in range(100_000):  # bounded: a round ends in about prompt chunks + out_len steps
        if not core.has_work():
            break
        core.step()
        steps += 1
    torch.cuda.synchronize()
    return steps, time.perf_counter() - t0


def step_kinds_round(core: EngineCore, tag: str, shape: tuple[int, int, int], rng: random.Random) -> dict[str, dict[str, float]]:
    """One round of fresh prompts, synchronized after each step: per kind of step launched
    (`decode`, `prefill`), its steps, scheduled tokens and wall seconds (host work plus that step's
    device time: the step read in the same call finished before it)."""
    add_round(core, tag, shape, rng)
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "tokens": 0, "s": 0.0})
    torch.cuda.synchronize()
    for _ in range(100_000):  # bounded, as rollout_round
        if not core.has_work():
            break
        t0 = time.perf_counter()
        core.step()
        torch.cuda.synchronize()
        launched = core.in_flight.batch if core.in_flight is not None else None
        kind = kinds["decode" if launched is not None and launched.is_decode else "prefill" if launched is not None else "read only"]
        kind["steps"] += 1
        kind["tokens"] += launched.num_tokens if launched is not None else 0
        kind["s"] += time.perf_counter() - t0
    return dict(kinds)


def phases_round(core: EngineCore, tag: str, shape: tuple[int, int, int], rng: random.Random) -> dict[str, Any]:
    """One round with the host's seconds and calls in each phase of a step (a phase's time includes
    the phases it calls): the methods below wrapped by a timer for the round, then put back."""
    from engine.runner import model_runner
    from engine.runner.pinned import PinnedRing
    from engine.runner.sampler import SampledOnDevice
    from engine.runner.step_inputs import Uploader

    runner = core.runner
    targets: list[tuple[str, Any, str]] = [
        ("step", core, "step"), ("schedule", core.scheduler, "schedule"), ("launch", runner, "launch"),
        ("plan", model_runner, "plan_step"), ("graph replay", runner.graphs, "run"),
        ("sampling inputs", model_runner.SamplingBatch, "from_plan"), ("sampler", runner.sampler, "sample"),
        ("uploads", Uploader, "_copy"), ("pinned buffers", PinnedRing, "take"), ("event waits", torch.cuda.Event, "synchronize"),
        ("read", core, "_read"), ("wait for tokens", SampledOnDevice, "wait"), ("resolve", core.scheduler, "resolve"),
    ]  # fmt: skip
    targets = [t for t in targets if t[1] is not None]  # no graphs: every step eager
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    saved = [(obj, attr, obj.__dict__.get(attr, None)) for _, obj, attr in targets]

    def timer(name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - t0
                calls[name] += 1
        return timed

    for name, obj, attr in targets:
        fn = getattr(obj, attr)
        if isinstance(obj.__dict__.get(attr), classmethod):
            setattr(obj, attr, staticmethod(timer(name, fn)))  # the bound classmethod, as a static one
        else:
            setattr(obj, attr, timer(name, fn))  # an instance's method, or a class's plain function
    try:
        steps, wall = rollout_round(core, tag, shape, rng)
    finally:
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
    return {"steps": steps, "wall_s": wall, "seconds": dict(seconds), "calls": dict(calls)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.6b", help="0.6b | 8b | DIR (as bench_engine.py takes it)")
    p.add_argument("--model-dir")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--cprofile", type=int, default=0, help="then a round under cProfile: its K functions of most own time")
    p.add_argument("--host-phases", action="store_true", help="then a round with the host's time by phase of a step")
    p.add_argument("--deterministic", action="store_true", help="the engine in --deterministic (issue 76)")
    p.add_argument("--no-batch-decode", action="store_true", help="the engine without its batch decode (EngineConfig.batch_decode)")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds before the profiled one, each printed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    shape = (args.requests, args.prompt_len, args.output_len)
    ckpt = checkpoint(args.shape, args.model_dir, torch.device("cuda"), seed=0)
    core = EngineCore(EngineConfig(model=ckpt["path"], device="cuda", load_format=ckpt.get("load_format", "auto"),
                                   max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.requests,
                                   deterministic=args.deterministic, batch_decode=not args.no_batch_decode))  # fmt: skip
    with engine_process_heap(), triton_compiles() as seen:  # the heap as the engine process runs (engine/core/loop.py)
        rng = random.Random(0)
        steps, wall = rollout_round(core, "warm", shape, rng)  # the first compiles of every row count
        say(f"untimed round: {steps} steps, {wall:.3f} s; {compiles_since(seen, 0)}")
        for r in range(args.rounds):
            start = len(seen)
            steps, wall = rollout_round(core, f"timed{r}-", shape, rng)
            tok_s = args.requests * args.output_len / wall
            say(f"timed round {r}: {steps} steps, {wall:.3f} s, {tok_s:.0f} tok/s; {compiles_since(seen, start)}")
        timed_end = len(seen)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            prof_steps, prof_wall = rollout_round(core, "profiled", shape, rng)
        events = device_events(prof)
        rows = [(name, n, us / 1e3) for name, n, us in kernel_times(events)]  # ms in the round
        busy = sum(ms for _, _, ms in rows)
        gaps = idle_gaps(events, prof_steps)
        mode = ("--deterministic" if args.deterministic else "default") + (" --no-batch-decode" if args.no_batch_decode else "")
        print_table(f"RL round ({mode}, {args.requests} x {args.prompt_len} + {args.output_len}): wall {prof_wall * 1e3:.0f} ms "
                    f"under the profiler in {prof_steps} steps, kernels {busy:.0f} ms",
                    ["kernel", "launches", "device ms", "share"],
                    [[f"`{n}`", c, ms, ms / busy] for n, c, ms in rows[: args.top]])  # fmt: skip
        print_table(f"RL round ({mode}): the device's idle gaps between kernels (top 20 pairs: "
                    f"{sum(g['us_per_step'] for g in gaps) * prof_steps / 1e3:.0f} ms in the round)",
                    ["kernel before", "kernel after", "gaps a step", "idle us a step"],
                    [[f"`{g['before']}`", f"`{g['after']}`", g["count_per_step"], g["us_per_step"]] for g in gaps[: args.top]])  # fmt: skip
        result: dict[str, Any] = {"shape": ckpt["shape"], "deterministic": args.deterministic, "steps": steps,
                                  "wall_s": wall, "tokens_per_s": tok_s, "profiled_wall_s": prof_wall, "kernel_ms": busy,
                                  "kernels": [{"name": n, "launches": c, "ms": ms} for n, c, ms in rows], "gaps": gaps}  # fmt: skip
        kinds = step_kinds_round(core, "kinds", shape, rng)
        print_table(f"RL round ({mode}), synchronized after each step: wall by the kind of step launched",
                    ["step", "steps", "tokens", "wall ms", "ms a step"],
                    [[k, v["steps"], v["tokens"], v["s"] * 1e3, v["s"] * 1e3 / max(v["steps"], 1)] for k, v in kinds.items()])  # fmt: skip
        result["step_kinds"] = kinds
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            _, host_wall = rollout_round(core, "cprofile", shape, rng)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
            print(f"## RL round ({mode}) under cProfile: wall {host_wall * 1e3:.0f} ms\n{text.getvalue()}")
            result["cprofile"] = text.getvalue()
        if args.host_phases:
            ph = phases_round(core, "phases", shape, rng)
            n = ph["steps"]
            print_table(f"RL round ({mode}): the host's time by phase, {n} steps in {ph['wall_s'] * 1e3:.0f} ms (a phase includes those it calls)",
                        ["phase", "calls a step", "ms in the round", "us a step"],
                        [[k, ph["calls"][k] / n, v * 1e3, v * 1e6 / n] for k, v in ph["seconds"].items()])  # fmt: skip
            result["host_phases"] = ph
        say(f"the rounds after the timed ones: {compiles_since(seen, timed_end)}")
        result["compiles"] = [{"kernel": n, "s": t} for n, t in seen]
        write_json(args.out, result)
    core.close()


if __name__ == "__main__":
    main()
