"""What the one-row decode step's tail costs after the last layer: the model's final norm
(`finish_kernel`), the logits (`skinny_linear`, LOGITS_CONFIG, PDL prefetch) and the greedy
sampler (`lse_argmax`, publishing to pinned memory, as the decode graphs' `GraphIO.sample` does),
each added in turn to a CUDA graph that repeats them, in the engine's launch order and options.
The differences bound what folding a kernel into its neighbour could save (bench/RESULTS.md,
forty-eighth session: the sampler folded into the logits' epilogue cost more than its launch).

    python3 bench/probe_step_tail.py --rows 1 --out $OUT/tail.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
import torch
from bench_linear import time_graph
from bench_runtime import say, write_json

HIDDEN, VOCAB, KS_D = 1024, 151936, 4  # Qwen3-0.6B; down_proj's K splits in the fused decode


def tails(rows: int, sampler_configs: list[tuple[int, int]]) -> dict[str, Callable[[], None]]:
    """Name -> one step's tail (a prefix of finish, logits, sampler) on static buffers; the
    sampler also at each of `sampler_configs` (columns per program, warps) after the logits."""
    from engine.models.layer_kernel import finish_kernel
    from engine.models.skinny_linear import LOGITS_CONFIG, skinny_linear
    from engine.runner.lse_argmax import graph_config, lse_argmax

    dev = torch.device("cuda")
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    h_mid, h, x = (torch.randn(rows, HIDDEN, **bf16) for _ in range(3))
    down = torch.randn(KS_D, rows, HIDDEN, dtype=torch.float32, device=dev)
    norm_w = torch.rand(HIDDEN, **bf16) + 0.5
    w = torch.randn(VOCAB, HIDDEN, **bf16) * 0.02  # past L2: every repetition streams it
    logits = torch.empty(rows, VOCAB, **bf16)
    temps = torch.ones(rows, dtype=torch.float32, device=dev)
    counters = torch.zeros(2 + rows, dtype=torch.int32, device=dev)
    out = (torch.empty(rows, device=dev), torch.empty(rows, dtype=torch.int64, device=dev),
           torch.empty(rows, 2, dtype=torch.float64, device=dev))  # fmt: skip
    host = torch.zeros(2, rows, 2, dtype=torch.float64, pin_memory=True)

    def finish() -> None:
        finish_kernel[(rows,)](h_mid, down, norm_w, h, x, rows * HIDDEN, rows, 1e-6, HID=HIDDEN, KS_D=KS_D, BLOCK=HIDDEN, num_warps=4)

    def logits_() -> None:
        skinny_linear(x, w, out=logits, prefetch=True, **LOGITS_CONFIG)

    def sample(config: tuple[int, int] = graph_config(rows)) -> None:
        lse_argmax(logits, temps, counters[2:], config=config, out=out, publish=(host, counters[1:2], counters[:1]))

    return {
        "logits": logits_,
        "logits + sampler": lambda: (logits_(), sample()),
        "finish + logits": lambda: (finish(), logits_()),
        "finish + logits + sampler": lambda: (finish(), logits_(), sample()),
        **{f"logits + sampler {c}x{n}": lambda c=c, n=n: (logits_(), sample((c, n))) for c, n in sampler_configs},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--per", type=int, default=20, help="tails per graph")
    p.add_argument("--reps", type=int, default=30, help="graph replays (the median is reported)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampler-configs", default="", help="','-separated COLUMNSxWARPS of the sampler to time too (e.g. 1024x4,4096x4)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    configs = [(int(c), int(w)) for c, w in (spec.split("x") for spec in filter(None, args.sampler_configs.split(",")))]
    calls = tails(args.rows, configs)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):  # rounds interleaved, so drift reaches every variant alike
        for name, call in calls.items():
            times[name].append(time_graph(lambda call=call: [call() for _ in range(args.per)], args.per, args.reps))
    base = min(times["logits"])
    print(f"| tail ({args.rows} rows) | us per step, each round | best | over the logits alone |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {' / '.join(f'{t:.2f}' for t in ts)} | {min(ts):.2f} | {min(ts) - base:+.2f} |")
    say(f"logits weight {VOCAB * HIDDEN * 2 / 1e6:.0f} MB: {VOCAB * HIDDEN * 2 / base / 1e6:.2f} TB/s")
    write_json(args.out, {"rows": args.rows, "times_us": times})


if __name__ == "__main__":
    main()
