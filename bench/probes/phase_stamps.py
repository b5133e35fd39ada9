"""Where a persistent batch-decode launch's time goes, phase by phase: the engine's own decode steps
(CUDA graphs, as served) with the batch kernel's TIMING stamps on (engine/kernels/grid_barrier.py
`stamp`), for `--deterministic`'s batch decode (engine/decode/batch_decode.py). Prints, per batch
size, the microseconds from a launch's first program leaving its PDL wait (point 12) to the first
and to the last program reaching each point, medians over the middle layers' launches of
`--steps` steps.

    python3 bench/probes/phase_stamps.py --shape 0.6b --batch-sizes 1,4 --out $OUT/stamps.json

The stamps tensor is captured with the graphs, so every replay writes it; the TIMING variant of
the kernel has a few more instructions than the served one (its step is slightly slower).
Needs a GPU: without one it exits 2 saying so.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from typing import Any

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH, os.path.join(BENCH, "probes")]

from bench_runtime import checkpoint_args, checkpoint_spec, require_gpu, say, write_json  # noqa: E402
from engine_shapes import checkpoint  # noqa: E402
from report import print_table  # noqa: E402

# batch_kernel.py's points: phase_end(POINT) stamps POINT on arrival and POINT + 1 on leaving
POINTS = {1: "o_proj", 2: "its barrier", 3: "norm", 4: "its barrier", 5: "gate_up", 6: "its barrier", 7: "down",
          8: "its barrier", 9: "norm", 10: "its barrier", 13: "qkv", 14: "its barrier", 15: "rope (phase 7)",
          16: "its barrier", 17: "items: rope", 20: "items: q landed", 21: "items: a piece's tiles done",
          18: "items: pieces stored", 19: "items: the last merging", 11: "the end"}  # fmt: skip


def install_stamps() -> dict[int, torch.Tensor]:
    """BatchDecode.forward with a stamps tensor of its own ([layers + 1, P, STAMPS] int64) in every
    call; returns {id(instance): tensor}, filled as the engine builds them."""
    from engine.decode import batch_decode
    from engine.kernels.grid_barrier import STAMPS

    tensors: dict[int, torch.Tensor] = {}
    forward = batch_decode.BatchDecode.forward

    def stamped(self, input_ids, positions, ctx, timing=None):  # noqa: ANN001, ANN202
        if id(self) not in tensors:
            programs = max(c[0]["P"] for c in self.launch_sets.values())
            tensors[id(self)] = torch.zeros(len(self.lm.layers) + 1, programs, STAMPS.value, dtype=torch.int64,
                                            device=self.h.device)  # fmt: skip
        return forward(self, input_ids, positions, ctx, timing=tensors[id(self)])

    batch_decode.BatchDecode.forward = stamped
    return tensors


def start_rows(core: Any, bs: int, context: int, steps: int, rng: random.Random) -> None:
    """bs greedy requests of `context` random prompt tokens, stepped until every one decodes."""
    from engine.core.protocol import AddRequest
    from engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(bs):
        prompt = [rng.randrange(core.model_config.vocab_size) for _ in range(context)]
        assert core.add_request(AddRequest(request_id=f"s{bs}-{i}", prompt_token_ids=prompt, sampling_params=params)) is None
    started: set[str] = set()
    for _ in range(10_000):
        started |= {d.request_id for d in core.step() if d.new_token_ids}
        if len(started) == bs:
            return
    raise RuntimeError("the rows' prefill does not finish")


def read(stamps: torch.Tensor) -> dict[int, list[tuple[float, float]]]:
    """Per point, of every launch but the first and last: (first, last) program to reach it, us
    after the launch's first start."""
    t = stamps.cpu()
    out: dict[int, list[tuple[float, float]]] = {p: [] for p in POINTS}
    for launch in range(1, t.shape[0] - 1):
        row = t[launch]
        starts = row[:, 12][row[:, 12] > 0]
        if starts.numel() == 0:
            continue
        for p in POINTS:
            v = row[:, p][row[:, p] > 0]
            if v.numel():
                out[p].append(((v.min() - starts.min()).item() / 1000, (v.max() - starts.min()).item() / 1000))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_args(p)
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    require_gpu(args.out, "phase_stamps.py")
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    tensors = install_stamps()
    ckpt = checkpoint(checkpoint_spec(args), args.model_dir, torch.device("cuda"), args.seed)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    config = EngineConfig(
        model=ckpt["path"], device="cuda", mem_fraction=0.6, max_model_len=max(2048, args.context + 4 * args.steps + 128),
        max_num_seqs=max(sizes), cuda_graph_max_bs=max(sizes), load_format=ckpt.get("load_format", "auto"),
        weights_backup="none", deterministic=True,
    )  # fmt: skip
    core = EngineCore(config)
    if not tensors:
        sys.exit("no BatchDecode ran: the mode's batch decode did not attach to this shape")
    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    for bs in sizes:
        start_rows(core, bs, args.context, args.steps, rng)
        points: dict[int, list[tuple[float, float]]] = {p: [] for p in POINTS}
        for _ in range(args.steps):
            with torch.inference_mode():  # the engine made the tensors in inference mode
                for t in tensors.values():
                    t.zero_()
            core.step()
            torch.cuda.synchronize()
            for t in tensors.values():
                for k, v in read(t).items():
                    points[k] += v
        core.abort(None)
        while core.has_work():
            core.step()
        medians = {k: (statistics.median(f for f, _ in v), statistics.median(la for _, la in v)) for k, v in points.items() if v}
        results.append({"batch_size": bs, "context": args.context, "us_first_last": medians})
        rows = [[k, POINTS[k], f"{f:.2f}", f"{la:.2f}"] for k, (f, la) in sorted(medians.items(), key=lambda kv: kv[1][1])]
        print_table(f"batch decode launch, bs={bs}, context {args.context} (us from the first program's start)",
                    ["point", "phase", "first program", "last program"], rows)  # fmt: skip
        say(f"bs={bs}: {len(points[11])} launches")
    write_json(args.out, {"shape": ckpt["shape"], "batches": results})
    core.close()


if __name__ == "__main__":
    main()
