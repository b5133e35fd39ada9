"""Speculative decoding benchmark (`--speculative-algorithm ngram`, engine/core/drafts.py): tokens per
second per sequence with drafts against plain decoding, on the same prompts in one run, and
whether the outputs are identical.

    python3 bench/bench_speculative.py --shape 0.6b --out $OUT/spec.json     # GPU
    python3 bench/bench_speculative.py --tiny --out /tmp/spec.json            # CPU smoke test
    python3 bench/bench_speculative.py --shape 0.6b --draft-model target --out $OUT/spec.json   # a draft model

Workloads, each at every `--batch-sizes` B (B prompts of `--prompt-len` random tokens, greedy,
`--output-len` new tokens, ignore_eos):
- `second rollout`: the prompts were generated once before (untimed), then again (timed): RL's
  repeated sampling of one prompt, where the first rollout drafts the second.
- `fresh`: prompts never seen: text that repeats only where the model repeats itself.
Plain decoding runs the same two rounds on its own engine, first; then the engine with drafts.
A ratio is (spec tok/s per sequence) / (plain tok/s per sequence) of the timed round; the targets
(issue 77): >= 2.0 at B=1 and >= 1.3 at B=8 on the repeating workload, >= 0.98 on fresh text.
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

from bench_runtime import checkpoint_args, checkpoint_spec, say, write_json  # noqa: E402
from report import print_table  # noqa: E402

TARGETS = {("second rollout", 1): 2.0, ("second rollout", 8): 1.3}
FRESH_TARGET = 0.98


def rounds(llm: Any, prompts_by_b: dict[int, list[list[int]]], fresh_by_b: dict[int, list[list[int]]],
           output_len: int) -> dict[str, Any]:  # fmt: skip
    """Per (workload, B): the timed round's wall seconds, output ids and engine steps (so a step's
    time and its tokens are wall / steps and tokens / steps)."""
    from engine import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for b, prompts in prompts_by_b.items():
        llm.generate(input_ids=prompts, sampling_params=params)  # the first rollout, untimed
        for name, batch in (("second rollout", prompts), ("fresh", fresh_by_b[b])):
            steps0 = llm.get_server_info()["num_steps"]
            t0 = time.perf_counter()
            res = llm.generate(input_ids=batch, sampling_params=params)
            wall = time.perf_counter() - t0
            steps = llm.get_server_info()["num_steps"] - steps0
            out[f"{name}|{b}"] = {"wall_s": wall, "ids": [r.output_ids for r in res], "steps": steps}
            say(f"  {name} B={b}: {output_len * len(batch) / wall:.1f} tok/s in all, {output_len / wall:.1f} per sequence; "
                f"{steps} steps, {wall / max(steps, 1) * 1e3:.3f} ms and {output_len * len(batch) / max(steps, 1):.2f} "
                "tokens a step")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_args(p)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prompt-len", type=int, help="default 256 (32 with --tiny)")
    p.add_argument("--output-len", type=int, help="default 512 (48 with --tiny)")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--draft-model", help="drafts from a draft model (--speculative-algorithm draft) in place of "
                   "n-grams: a checkpoint directory of the same vocabulary, or `target` (the benchmark's own "
                   "checkpoint: every draft stands, the draft path's cost at full acceptance)")
    p.add_argument("--server-args", default="", help="more EngineConfig fields, as key=value[,key=value]")
    args = p.parse_args()
    import torch
    from engine_shapes import checkpoint

    from engine import Engine

    device = torch.device("cpu" if args.tiny else "cuda")
    prompt_len = args.prompt_len or (32 if args.tiny else 256)
    output_len = args.output_len or (48 if args.tiny else 512)
    ckpt = checkpoint(checkpoint_spec(args), args.model_dir, device, args.seed)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rng = random.Random(args.seed)
    vocab = min(ckpt["shape"]["vocab_size"], 512) if args.tiny else ckpt["shape"]["vocab_size"]
    draw = lambda n: [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]  # noqa: E731
    prompts, fresh = {b: draw(b) for b in sizes}, {b: draw(b) for b in sizes}
    # max_num_seqs: a verify step of B requests is B x (drafts + 1) decode rows, each a sequence of
    # the step's attention (engine/runner/step_plan.py), replayed from a graph of that many rows.
    knobs: dict[str, Any] = dict(max_model_len=prompt_len + output_len + 64, load_format=ckpt.get("load_format", "auto"),
                                 max_num_seqs=max(sizes) * (args.num_draft_tokens + 1), device=device.type)  # fmt: skip
    if args.tiny:
        knobs |= dict(dtype="float32", num_kv_blocks=256)
    for kv in filter(None, args.server_args.split(",")):
        key, value = kv.split("=", 1)
        knobs[key] = type(knobs[key])(value) if key in knobs else value
    res: dict[str, Any] = {"shape": ckpt["shape"], "args": vars(args), "modes": {}}
    drafts: dict[str, Any] = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=args.num_draft_tokens)
    if args.draft_model:
        path = ckpt["path"] if args.draft_model == "target" else args.draft_model
        drafts |= dict(speculative_algorithm="draft", speculative_draft_model_path=path)
    algorithm = drafts["speculative_algorithm"]  # the speculative engine's mode in the JSON: ngram or draft
    for mode, extra in (("plain", {}), (algorithm, drafts)):
        say(f"{mode}: starting the engine")
        with Engine(model=ckpt["path"], **knobs, **extra) as llm:
            res["modes"][mode] = rounds(llm, prompts, fresh, output_len)
            info = llm.get_server_info()
            res["modes"][mode]["drafted"] = (info["spec_draft_tokens"], info["spec_accepted_tokens"])
        write_json(args.out, res)
    plain, spec = res["modes"]["plain"], res["modes"][algorithm]
    rows = []
    for key in (k for k in plain if "|" in k):
        name, b = key.split("|")
        ratio = plain[key]["wall_s"] / spec[key]["wall_s"]
        target = TARGETS.get((name, int(b)), FRESH_TARGET if name == "fresh" else None)
        same = plain[key]["ids"] == spec[key]["ids"]
        rows.append([f"{name}, B={b}: tok/s per sequence", round(output_len / spec[key]["wall_s"], 1),
                     round(output_len / plain[key]["wall_s"], 1), round(ratio, 3), f">= {target}" if target else "-",
                     "PASS" if target and ratio >= target and same else ("FAIL" if target else "-"), same])  # fmt: skip
    drafted, kept = spec["drafted"]
    drafter = f"draft model {args.draft_model}" if args.draft_model else "ngram"
    print_table(f"siesta speculative decoding ({drafter}) against plain decoding, " + ("CPU tiny" if args.tiny else str(device)),
                ["metric", "draft model" if args.draft_model else "ngram", "plain", "ratio", "target", "ok", "outputs identical"], rows,
                [f"draft tokens {drafted}, accepted {kept} ({kept / max(drafted, 1):.2f})"])  # fmt: skip
    res["table"] = rows
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
