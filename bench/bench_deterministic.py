"""The cost of `--deterministic` (issue 76): the same work on an engine in the default mode and on
engines in the deterministic mode, one after the other in one run, and each mode's figure over
the default's.

    python3 bench/bench_deterministic.py --shape 0.6b --out $OUT/det.json     # GPU; --shape 8b
    python3 bench/bench_deterministic.py --tiny --out /tmp/det.json            # CPU smoke test

Sections, per mode (`default`, then `deterministic` with each of `--backends`, and with
`--ab-batch-decode` each backend again without the mode's batch decode (`batch_decode=False`, as
`--no-batch-decode`: decode steps of the layers one op at a time); each engine with its CUDA
graphs, freed before the next is built):
- decode: the median step time of B greedy sequences after `--context` prompt tokens each
  (engine_decode.py; the median, as one stalled step of 30 moves a mean by a third), for each B
  of `--batch-sizes`. Target: the mode's step <= 1.10x the default's at B 1, 64 and 256.
- rl: RL rollouts on the engine, in process: `--rl-requests` prompts of `--rl-len` random tokens,
  each sampling `--rl-len` tokens (temperature 1, ignore_eos, logprobs), all at once; output
  tokens per second, the mode's over the default's (the target, >= 0.90, is for RL traffic over
  HTTP: bench_serving.py `--compare-server-args=--deterministic`). An untimed round first (the
  kernels a prefill's row counts first meet compile there, not in the figure), then
  `--rl-rounds` rounds of new prompts (no prefix-cache hit), their median.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import checkpoint_args, checkpoint_spec, engine_process_heap, say, write_json  # noqa: E402
from report import cell, print_table, verdict  # noqa: E402

DECODE_TARGET = 1.10  # the mode's decode step over the default's, at most
DECODE_TARGET_BATCHES = (1, 64, 256)
RL_TARGET = 0.90  # the mode's RL tokens per second over the default's, at least


def rl_rollouts(core: Any, args: argparse.Namespace, vocab: int, round_: int) -> dict[str, Any]:
    """Output tokens per second of `--rl-requests` sampled rollouts with logprobs, all at once;
    round `round_`'s prompts (their own random tokens)."""
    from engine.core.protocol import AddRequest
    from engine.request import SamplingParams

    rng = random.Random(args.seed + 2 + 1000 * round_)
    sp = SamplingParams(max_new_tokens=args.rl_len, temperature=1.0, ignore_eos=True, logprobs=True)
    t0 = time.perf_counter()
    for i in range(args.rl_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(args.rl_len)]
        err = core.add_request(AddRequest(request_id=f"rl-{round_}-{i}", prompt_token_ids=prompt, sampling_params=sp))
        if err is not None:
            raise RuntimeError(f"request refused: {err.error}")
    tokens, steps = 0, 0
    while core.has_work():
        for d in core.step():
            if d.error:
                raise RuntimeError(f"request {d.request_id} failed: {d.error}")
            tokens += len(d.new_token_ids)
        steps += 1
        if steps > 100 * args.rl_len * args.rl_requests:
            raise RuntimeError("the rollouts do not finish")
    wall = time.perf_counter() - t0
    if tokens != args.rl_requests * args.rl_len:
        raise RuntimeError(f"{tokens} output tokens, expected {args.rl_requests * args.rl_len}")
    what = "warm-up" if round_ == 0 else f"round {round_}"
    say(f"  rl {what}: {args.rl_requests} x {args.rl_len} in {wall:.2f} s: {tokens / wall:.0f} tok/s in {steps} steps")
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps}


def measure(args: argparse.Namespace, path: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """One engine of `knobs`: its decode steps at every batch size, then its RL rollouts."""
    import torch
    from device_timing import free_memory
    from engine_decode import decode_steps
    from engine_graphs import count_graph_replays

    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    device = torch.device(args.device)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(model=path, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                                   max_num_seqs=max(sizes + [args.rl_requests]), seed=args.seed, **knobs))  # fmt: skip
    try:
        with engine_process_heap():  # as the engine process runs (engine/core/loop.py)
            info = core.get_info()
            out: dict[str, Any] = {"attention_backend": info["attention_backend"],
                                   "graph_batch_sizes": info["cuda_graph_batch_sizes"][-1:], "decode": {}}  # fmt: skip
            say(f"  engine: backend {out['attention_backend']}, graphs up to bs {out['graph_batch_sizes'] or 'none'}")
            replays, rng = count_graph_replays(core), random.Random(args.seed + 1)
            for bs in sizes:
                step = decode_steps(core, args, bs, rng, 0, 0, None, replays)
                out["decode"][bs] = {k: step[k] for k in ("step_mean_s", "step_median_s", "graph_replayed_steps", "steps")}
            vocab = core.model_config.vocab_size
            warmup = rl_rollouts(core, args, vocab, 0)
            rounds = sorted((rl_rollouts(core, args, vocab, r) for r in range(1, args.rl_rounds + 1)),
                            key=lambda r: r["tokens_per_s"])  # fmt: skip
            out["rl"] = rounds[(len(rounds) - 1) // 2] | {"rounds_tok_s": [r["tokens_per_s"] for r in rounds],
                                                          "warmup_tok_s": warmup["tokens_per_s"]}  # fmt: skip
            return out
    finally:
        del core
        free_memory(device)


def table(res: dict[str, Any], sizes: list[int]) -> list[list[Any]]:
    base = res["modes"]["default"]
    rows = []
    for name, mode in res["modes"].items():
        if name == "default":
            continue
        for bs in sizes:
            ratio = mode["decode"][bs]["step_median_s"] / base["decode"][bs]["step_median_s"]
            ok = ratio <= DECODE_TARGET if bs in DECODE_TARGET_BATCHES else None
            rows.append([f"{name}: decode step, bs={bs}", f"{mode['decode'][bs]['step_median_s'] * 1e3:.3f} ms",
                         f"{base['decode'][bs]['step_median_s'] * 1e3:.3f} ms", f"{cell(ratio)}x",
                         f"<= {DECODE_TARGET}x" if ok is not None else "-", verdict(ok)])  # fmt: skip
        ratio = mode["rl"]["tokens_per_s"] / base["rl"]["tokens_per_s"]
        rows.append([f"{name}: RL rollouts (engine), tok/s", round(mode["rl"]["tokens_per_s"]),
                     round(base["rl"]["tokens_per_s"]), cell(ratio), f">= {RL_TARGET}", verdict(ratio >= RL_TARGET)])  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_args(p)
    p.add_argument("--backends", default="auto", help="the deterministic engines' attention backends, comma-separated "
                   "(auto: the mode's default; triton_fixed, sdpa_rows)")  # fmt: skip
    p.add_argument("--batch-sizes", help="default 1,64,256 (1,4 with --tiny)")
    p.add_argument("--context", type=int, help="prompt tokens of each decode sequence (default 512; 32 with --tiny)")
    p.add_argument("--decode-steps", type=int, default=30, help="timed decode steps per batch size")
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--rl-requests", type=int, help="default 256 (4 with --tiny)")
    p.add_argument("--rl-len", type=int, help="prompt and output tokens of each rollout (default 256; 16 with --tiny)")
    p.add_argument("--rl-rounds", type=int, default=3, help="timed RL rounds after the warm-up; their median")
    p.add_argument("--ab-batch-decode", action="store_true",
                   help="also each backend's engine without the mode's batch decode (batch_decode=False)")
    args = p.parse_args()
    if args.rl_rounds < 1:
        p.error("--rl-rounds must be at least 1")
    import torch
    from engine_decode import decode_new_tokens
    from engine_shapes import checkpoint

    args.device, args.dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    args.batch_sizes = args.batch_sizes or ("1,4" if args.tiny else "1,64,256")
    args.decode_context = args.context or (32 if args.tiny else 512)
    args.rl_requests = args.rl_requests or (4 if args.tiny else 256)
    args.rl_len = args.rl_len or (16 if args.tiny else 256)
    args.max_model_len = -(-max(args.decode_context + decode_new_tokens(args), 2 * args.rl_len) // 256) * 256
    ckpt = checkpoint(checkpoint_spec(args), args.model_dir, torch.device(args.device), args.seed)
    if ckpt["load_format"] != "auto":
        raise SystemExit(f"{ckpt['path']} has no weights: the deterministic mode serves dense checkpoints")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    res: dict[str, Any] = {"shape": ckpt["shape"], "args": vars(args), "modes": {}}
    modes = [("default", {})] + [(f"deterministic ({b}{'' if batch else ', no batch decode'})",
                                  dict(deterministic=True, attention_backend=b, batch_decode=batch))
                                 for b in args.backends.split(",") for batch in (True, False)[: 1 + args.ab_batch_decode]]  # fmt: skip
    for name, knobs in modes:
        say(f"{name}:")
        res["modes"][name] = measure(args, ckpt["path"], knobs)
        write_json(args.out, res)
    res["table"] = table(res, sizes)
    device = "CPU tiny" if args.tiny else torch.cuda.get_device_name()
    print_table(f"siesta --deterministic against the default mode, {device}, context {args.decode_context}",
                ["metric", "deterministic", "default", "ratio", "target", "ok"], res["table"])  # fmt: skip
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
