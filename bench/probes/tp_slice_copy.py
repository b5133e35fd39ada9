"""What a tensor-parallel rank pays to take its slices out of a flattened bucket it received whole
(engine/weights/group_updates.py, "bucket via scratch"): the rank's model on one GPU (a rank of
`--tp-size`, no process group needed: the slices are the loader's), one scratch of the model's
full bytes in Hugging Face's order, then `load_named_tensors` into the rank's weights, timed by
parts (host validation, host launch, device completion), the scratch's malloc and free, and a
torch.profiler table of the copy's kernels. A device-to-device copy of the rank's bytes is the
reference.

    python3 bench/probes/tp_slice_copy.py --shape 8b            # one H200
    python3 bench/probes/tp_slice_copy.py --shape tiny --cpu    # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from engine_shapes import SHAPES  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.models import get_model_class  # noqa: E402
from engine.parallel import TensorParallel  # noqa: E402
from engine.weights.loader import load_named_tensors, validate_entries  # noqa: E402
from engine.weights.store import WeightStore  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=["0.6b", "8b", "tiny"])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu else "cuda")
    from transformers import Qwen3Config

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as d:
        Qwen3Config(**shape, architectures=["Qwen3ForCausalLM"], torch_dtype="bfloat16").save_pretrained(d)
        config = ModelConfig.from_hf(d)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, fused=False, tp=TensorParallel(rank=0, size=args.tp_size))
    torch.set_default_dtype(torch.float32)
    store = WeightStore(model, device)
    targets = {n: t for n, t in store.targets.items() if not t.covers}
    sizes = [(n, t.shape) for n, t in targets.items()]
    total = sum(torch.Size(s).numel() * 2 for _, s in sizes)
    print(f"{args.shape} at tp {args.tp_size}: {len(sizes)} tensors, bucket {total / 1e9:.2f} GB, "
          f"rank's weights {store.nbytes / 1e9:.2f} GB", flush=True)

    def bucket() -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        pairs, offset = [], 0
        for name, s in sizes:
            n = torch.Size(s).numel() * 2
            pairs.append((name, flat[offset : offset + n].view(torch.bfloat16).view(s)))
            offset += n
        return flat, pairs

    rows: dict[str, list[float]] = {}
    for i in range(args.iters + 1):
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        flat, pairs = bucket()
        sync(device)
        t1 = time.perf_counter()
        validate_entries(model, ((n, tuple(t.shape), t.dtype) for n, t in pairs), store.targets)
        t2 = time.perf_counter()
        load_named_tensors(model, pairs, require_all=False, targets=store.targets)
        t3 = time.perf_counter()
        sync(device)
        t4 = time.perf_counter()
        del flat, pairs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t5 = time.perf_counter()
        if i:
            for k, v in (("malloc + views", t1 - t0), ("validate (host)", t2 - t1), ("load_named_tensors (host)", t3 - t2),
                         ("device tail after it", t4 - t3), ("free (empty_cache)", t5 - t4)):
                rows.setdefault(k, []).append(v)
    ref = []
    src = torch.empty(store.nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for i in range(args.iters + 1):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i:
            ref.append(time.perf_counter() - t)
    del src, dst
    for k, v in rows.items():
        print(f"{k:32s} {statistics.median(v) * 1e3:8.2f} ms", flush=True)
    print(f"{'ref: d2d copy of the rank bytes':32s} {statistics.median(ref) * 1e3:8.2f} ms", flush=True)
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        flat, pairs = bucket()
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            load_named_tensors(model, pairs, require_all=False, targets=store.targets)
            sync(device)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
