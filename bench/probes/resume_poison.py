"""Which lost region corrupts the first forwards after a resume: an in-process `EngineCore` runs 8
greedy prompts for a reference, then for each region releases and resumes it alone through the
engine's own calls and runs the prompts again (twice: the first run meets the lost memory, the
second what the first left). A region whose runs differ from the reference names memory some
kernel reads without writing first. Ways to lose it (`--ways`):
- poison: no memory saver; a release then fills what the region holds on the device with NaN /
  0xFF bytes (engine/memory/poison.py), as a CPU release does;
- real: torch_memory_saver releases and maps the pages again (run under its LD_PRELOAD hook).

    python3 bench/probes/resume_poison.py --shape 0.6b          # H200: graphs and overlap on
    python3 bench/probes/resume_poison.py --tiny                # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from engine_shapes import checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core import calls  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.protocol import AddRequest  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    for i, p in enumerate(prompts):
        assert core.add_request(AddRequest(f"{tag}-{i}", p, GREEDY)) is None
    outs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not core.has_work():
            break
        for d in core.step():
            outs[d.request_id] += d.new_token_ids
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))]


def lose(core: EngineCore, region: str) -> None:
    """Release `region` alone and resume it, as a client's calls do (`all`: every region)."""
    tags = None if region == "all" else [region]
    core.release_memory_occupation(calls.ReleaseMemory(tags=tags)).run()
    core.resume_memory_occupation(calls.ResumeMemory(tags=tags))
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--regions", default="kv_cache,cuda_graph,weights", help="the regions lost, in turn (a crash ends the run)")
    ap.add_argument("--ways", default="poison", help="poison, real (start with torch_memory_saver's LD_PRELOAD)")
    ap.add_argument("--duplicates", action="store_true", help="prompts 0 and 1 ten times each, as the storm sends them")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    ckpt = checkpoint("tiny" if args.tiny else args.shape, args.model_dir, device, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, ckpt["shape"]["vocab_size"]) for _ in range(50)] for _ in range(8)]
    prompts = prompts[:2] * 10 if args.duplicates else prompts
    rows: list[list[object]] = []
    for how in args.ways.split(","):
        config = EngineConfig(model=ckpt["path"], device=device.type, max_model_len=512, num_kv_blocks=2048,
                              memory_saver=how == "real", cuda_graph_max_bs=16, disable_cuda_graph=args.eager)
        core = EngineCore(config)
        reference = run(core, prompts, f"{how}-ref")
        for region in args.regions.split(","):
            try:
                lose(core, region)
                first, second = run(core, prompts, f"{region}-{how}-1"), run(core, prompts, f"{region}-{how}-2")
                rows.append([region, how, str([i for i, o in enumerate(first) if o != reference[i]]),
                             str([i for i, o in enumerate(second) if o != reference[i]])])
            except Exception as e:  # noqa: BLE001 (a crash is this probe's finding)
                rows.append([region, how, f"{type(e).__name__}: {str(e)[:80]}", "-"])
                print(rows[-1], flush=True)
                break
            print(rows[-1], flush=True)
        core.close()
    print_table(f"regions lost before a run: {ckpt['path']} on {device} (graphs {'off' if args.eager else 'on'})",
                ["region", "lost by", "rows wrong, first run", "rows wrong, second run"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
