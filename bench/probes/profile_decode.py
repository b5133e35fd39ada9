"""Where a decode step's device time goes: torch.profiler over whole engine steps (`core.step()`,
CUDA graphs on, overlap on) of B running decodes, kernels grouped by name. Prints, per batch
size, one table: kernel | launches per step | device us per step | share, plus the step's wall
time and the sum of its kernels' time (the gap between them is idle device time).

    python3 bench/probes/profile_decode.py --shape 0.6b --batch-sizes 1,64 --out $OUT/profile.json
    python3 bench/probes/profile_decode.py --shape 0.6b --batch-sizes 64 --host --out $OUT/p.json  # cProfile
    python3 bench/probes/profile_decode.py --batch-sizes 64 --mixed 512 --host --out $OUT/p.json  # mixed steps
    python3 bench/probes/profile_decode.py --shape 8b --batch-sizes 1,64,256 --deterministic --out $OUT/p.json

`--no-pdl`: the engine without programmatic dependent launch. With it on, a kernel starts while the
one before finishes and waits for it, so its time includes that wait and the kernels' sum can
exceed the step; off, each kernel's time is its own.

`--mixed C`: every profiled step also admits a fresh prompt of C random tokens with
max_new_tokens 1, prefilled whole beside the B decodes (bench_engine.py's mixed step).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import sys
import time
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from device_timing import device_events, idle_gaps, kernel_times, path_times  # noqa: E402
from engine_shapes import checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.protocol import AddRequest  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def start_decodes(core: EngineCore, bs: int, context: int, steps: int, rng: random.Random) -> None:
    """bs requests of `context` random prompt tokens, run until every one decodes, then 5 steps
    (each asking for its routed experts when the engine records them)."""
    vocab = core.model_config.vocab_size
    routes = core.config.enable_return_routed_experts
    params = SamplingParams(max_new_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True, return_routed_experts=routes)
    for i in range(bs):
        prompt = [rng.randrange(vocab) for _ in range(context)]
        assert core.add_request(AddRequest(request_id=f"p{bs}-{i}", prompt_token_ids=prompt, sampling_params=params)) is None
    started: set[str] = set()
    for _ in range(10_000):  # until every request decodes, then a few more steps
        started |= {d.request_id for d in core.step() if d.new_token_ids}
        if len(started) == bs:
            break
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()


def admit(core: EngineCore, chunk: int, rng: random.Random) -> None:
    """With chunk > 0: a fresh prompt of `chunk` random tokens, one new token, for the next step."""
    if chunk > 0:
        prompt = [rng.randrange(core.model_config.vocab_size) for _ in range(chunk)]
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        assert core.add_request(AddRequest(request_id=f"chunk-{rng.random()}", prompt_token_ids=prompt, sampling_params=params)) is None


def profile_host(core: EngineCore, bs: int, context: int, steps: int, rng: random.Random, top: int, chunk: int) -> None:
    """cProfile of `steps` engine steps at bs running decodes (each with a `chunk`-token prompt
    beside them if chunk > 0): where the host's time per step goes."""
    start_decodes(core, bs, context, steps, rng)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        admit(core, chunk, rng)
        core.step()
    prof.disable()
    say(f"host profile bs={bs}: {(time.perf_counter() - t0) / steps * 1e6:.0f} us per step under cProfile")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(top)
    core.abort(None)
    while core.has_work():
        core.step()


def profile_batch(core: EngineCore, bs: int, context: int, steps: int, rng: random.Random, chunk: int) -> dict[str, Any]:
    start_decodes(core, bs, context, steps, rng)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            admit(core, chunk, rng)
            core.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    events = device_events(prof)
    core.abort(None)
    while core.has_work():
        core.step()
    path = path_times(events)
    rows = [(name, n / steps, us / steps, path[name] / steps) for name, n, us in kernel_times(events)]
    return {"batch_size": bs, "context": context, "steps": steps, "wall_us_per_step": wall * 1e6,
            "kernel_us_per_step": sum(r[2] for r in rows), "kernels_per_step": sum(r[1] for r in rows),
            "kernels": [{"name": n, "launches_per_step": c, "us_per_step": us, "path_us_per_step": on} for n, c, us, on in rows],
            "gaps": idle_gaps(events, steps)}


def print_profile(r: dict[str, Any], top: int) -> None:
    print_table(f"decode bs={r['batch_size']}, context {r['context']}: step wall {r['wall_us_per_step']:.0f} us, "
                f"kernels {r['kernel_us_per_step']:.0f} us ({r['kernels_per_step']:.0f} launches per step)",
                ["kernel", "launches per step", "device us per step", "share", "on the critical path, us per step"],
                [[f"`{k['name']}`", k["launches_per_step"], k["us_per_step"], k["us_per_step"] / r["kernel_us_per_step"],
                  k["path_us_per_step"]]
                 for k in r["kernels"][:top]])
    idle = sum(g["us_per_step"] for g in r["gaps"])
    print_table(f"largest idle gaps between kernels (top 20 pairs: {idle:.0f} us per step)",
                ["kernel before", "kernel after", "gaps per step", "idle us per step"],
                [[f"`{g['before']}`", f"`{g['after']}`", g["count_per_step"], g["us_per_step"]] for g in r["gaps"][:top]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.6b", help="0.6b | 8b | DIR (as bench_engine.py takes it)")
    p.add_argument("--model-dir")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--tp-size", type=int, default=1, help="profiles rank 0's kernels")
    p.add_argument("--host", action="store_true", help="cProfile the host's side of the steps instead")
    p.add_argument("--mixed", type=int, default=0, help="C: each step also prefills a fresh C-token prompt")
    p.add_argument("--routed-experts", action="store_true", help="record routed experts; every request asks for them")
    p.add_argument("--deterministic", action="store_true", help="the engine in --deterministic (issue 76)")
    p.add_argument("--no-pdl", action="store_true",
                   help="kernels launched without PDL: each kernel's time is its own, not overlapped with the one before")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda")
    ckpt = checkpoint(args.shape, args.model_dir, device, seed=0)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(model=ckpt["path"], device="cuda", mem_fraction=0.6,
                                   max_model_len=max(2048, args.context + 4 * args.steps + 128),
                                   max_num_seqs=max(sizes) + (args.mixed > 0), cuda_graph_max_bs=max(sizes), tp_size=args.tp_size,
                                   load_format=ckpt.get("load_format", "auto"), weights_backup="none",
                                   enable_return_routed_experts=args.routed_experts,
                                   deterministic=args.deterministic, pdl=not args.no_pdl))  # fmt: skip
    rng = random.Random(0)
    results = []
    for bs in sizes:
        say(f"profiling decode bs={bs}")
        if args.host:
            profile_host(core, bs, args.context, args.steps, rng, args.top, args.mixed)
            continue
        results.append(profile_batch(core, bs, args.context, args.steps, rng, args.mixed))
        print_profile(results[-1], args.top)
    write_json(args.out, {"shape": ckpt["shape"], "tp_size": args.tp_size, "deterministic": args.deterministic,
                          "batches": results})  # fmt: skip
    core.close()


if __name__ == "__main__":
    main()
