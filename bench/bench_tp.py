"""Tensor parallelism's decode step: the same shape at tp_size 1 and 2 in one run, CUDA graphs on.

    python bench/bench_tp.py --shape 8b --out tp.json

Prints one table: per batch size, the step at TP=1, at TP=2, and their ratio (target at batch 1:
TP=2's step 0.65x of TP=1's or less; the weights each GPU reads halve, the all-reduces are new).
`--expert-parallel` (a mixture-of-experts shape) runs TP=2 again with whole experts per rank
(`--enable-expert-parallel`) and adds its step against TP=2's sliced experts.

Each mode runs in a process of its own (`--mode`): rank 0 of a tensor-parallel engine lives in the
process that builds it and joins torch's one default process group there, and NCCL tears a group
down only with every rank at once, so a mode's engine goes away with its process.

    python bench/bench_tp.py --shape 30b-a3b --batch-sizes 1,64,256 --expert-parallel --out tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile

import torch
from bench_runtime import elapsed, say, write_json
from engine_decode import decode_steps
from engine_graphs import count_graph_replays
from engine_shapes import checkpoint
from report import Rows, over, print_targets, run_footer

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore

TARGET_BS1 = 0.65


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="8b")
    p.add_argument("--model-dir")
    p.add_argument("--device", default="cuda", help="cpu: the modes' paths over gloo, for the smoke test")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--decode-warmup", type=int, default=3)
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--expert-parallel", action="store_true", help="also TP=2 with whole experts per rank")
    p.add_argument("--mode", help=argparse.SUPPRESS)  # internal: measure this one mode, write its steps to --out
    return p.parse_args(argv)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def modes(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """(name, tp_size, whole experts per rank) for each engine the run builds."""
    return [(t, int(t), False) for t in args.tp_sizes.split(",")] + ([("2 ep", 2, True)] if args.expert_parallel else [])


def measure(args: argparse.Namespace, name: str) -> dict[int, float]:
    """One mode's mean decode step (s) per batch size, from one engine built in this process."""
    _, tp, ep = next(m for m in modes(args) if m[0] == name)
    ckpt = checkpoint(args.shape, args.model_dir, torch.device(args.device), 0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(
        model=ckpt["path"], load_format=ckpt["load_format"], device=args.device, dtype="bfloat16",
        max_model_len=args.max_model_len, tp_size=tp, enable_expert_parallel=ep,
        max_num_seqs=max(batch_sizes), cuda_graph_max_bs=max(batch_sizes), mem_fraction=args.mem_fraction,
    ))
    steps: dict[int, float] = {}
    try:
        replays = count_graph_replays(core)
        for bs in batch_sizes:
            out = decode_steps(core, args, bs, random.Random(bs), 0, 0, None, replays)
            steps[bs] = out["step_mean_s"]
            say(f"tp={name} bs={bs}: {out['step_mean_s'] * 1e3:.3f} ms, {out['graph_replayed_steps']}/{out['steps']} from graphs")
    finally:
        core.close()
    return steps


def measure_apart(argv: list[str], name: str) -> dict[int, float]:
    """`measure` in a child process: its engine, its ranks and its process group end with it."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench-tp-")
    os.close(fd)
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--mode", name, "--out", path], check=True)
        with open(path) as f:
            return {int(bs): s for bs, s in json.load(f).items()}
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mode is not None:
        write_json(args.out, measure(args, args.mode))
        return 0
    device = torch.device(args.device)
    ckpt = checkpoint(args.shape, args.model_dir, device, 0)  # built once, before the modes read it
    steps: dict[int, dict[str, float]] = {}  # batch -> run ("1", "2", "2 ep") -> mean step (s)
    for name, _, _ in modes(args):
        for bs, step in measure_apart(argv, name).items():
            steps.setdefault(bs, {})[name] = step
    rows = Rows()
    for bs, by_tp in steps.items():
        one, two, whole = by_tp.get("1"), by_tp.get("2"), by_tp.get("2 ep")
        ratio = over(two, one)
        held = bs == 1 and ratio is not None
        rows.add(f"decode step bs={bs}: TP=2 (ms); ref = TP=1", two and two * 1e3, one and one * 1e3, ratio,
                 f"<= {TARGET_BS1}" if bs == 1 else "-", ratio <= TARGET_BS1 if held else None)
        if whole is not None:
            rows.add(f"decode step bs={bs}: TP=2 whole experts (ms); ref = TP=2 sliced", whole * 1e3,
                     two and two * 1e3, over(whole, two))
    res = {"meta": {"out": args.out, "args": vars(args), "device_name": device_name(device)},
           "shape": ckpt["shape"], "steps_s": steps, "table": rows, "errors": {}}
    write_json(args.out, res)
    steps_from = "CUDA graphs" if device.type == "cuda" else "eager"
    print_targets(f"siesta tensor-parallel decode step: {res['meta']['device_name']}, {args.shape} shape, bf16, "
                  f"{steps_from}, context {args.decode_context}", rows, footer=run_footer(res, elapsed()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
