"""What grammar-constrained decoding (engine/runner/grammar.py) costs an engine step: B greedy
requests decoded with every row free, then with every row constrained by a regex that never has
to end (`[^\\n]*`, so the rows run their whole budget), on an in-process `EngineCore` (graphs and
overlap on). A constrained step reads the step before it (no overlap), fills each row's mask on
the host and samples outside the decode graph with the mask applied.

The benchmark checkpoints carry no tokenizer, so the demo tokenizer (512 tokens) is the grammar's
vocabulary: the mask still spans the model's vocabulary on the device, but the host's mask fill
is that of a small vocabulary (an underestimate for a 151k one).

    python3 bench/probes/grammar_cost.py --shape 0.6b --batch-sizes 1,16,64 --out $OUT/grammar.json
    python3 bench/probes/grammar_cost.py --tiny --out /tmp/grammar.json       # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from bench_runtime import say, write_json  # noqa: E402
from engine_shapes import checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.engine_core import EngineCore  # noqa: E402
from engine.core.protocol import AddRequest  # noqa: E402
from engine.demo_model import save_tokenizer  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def decode_rate(core: EngineCore, bs: int, new_tokens: int, regex: str | None, rng: random.Random, tag: str) -> float:
    """Output tokens per second of `bs` requests of 64 random prompt tokens, from admission on."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, regex=regex)
    vocab = min(core.model_config.vocab_size, 512)
    for i in range(bs):
        prompt = [rng.randrange(3, vocab) for _ in range(64)]
        assert core.add_request(AddRequest(f"{tag}-{i}", prompt, params)) is None
    t0, tokens = time.perf_counter(), 0
    while core.has_work():
        tokens += sum(len(d.new_token_ids) for d in core.step())
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.6b")
    p.add_argument("--model-dir")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    ckpt = checkpoint("tiny" if args.tiny else args.shape, args.model_dir, device, seed=0)
    tok_dir = tempfile.mkdtemp(prefix="siesta-grammar-tok-")
    save_tokenizer(tok_dir)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    core = EngineCore(EngineConfig(model=ckpt["path"], tokenizer=tok_dir, device=device.type, max_model_len=1024,
                                   max_num_seqs=max(sizes), mem_fraction=0.6, load_format=ckpt.get("load_format", "auto"),
                                   weights_backup="none", dtype="float32" if args.tiny else "auto"))  # fmt: skip
    rng, rows = random.Random(0), []
    new_tokens = 16 if args.tiny else args.new_tokens
    for bs in sizes:
        decode_rate(core, bs, 8, None, rng, f"warm-{bs}")  # compile, capture what this size needs
        decode_rate(core, bs, 8, r"[^\n]*", rng, f"warm-g-{bs}")
        free = decode_rate(core, bs, new_tokens, None, rng, f"free-{bs}")
        constrained = decode_rate(core, bs, new_tokens, r"[^\n]*", rng, f"grammar-{bs}")
        say(f"bs={bs}: free {free:.0f} tok/s, constrained {constrained:.0f} tok/s -> {constrained / free:.3f}")
        rows.append({"batch": bs, "free_tok_s": free, "constrained_tok_s": constrained, "ratio": constrained / free})
    write_json(args.out, {"shape": ckpt["shape"], "new_tokens": new_tokens, "rows": rows})
    print_table(f"grammar-constrained decode ({args.shape if not args.tiny else 'tiny'}, greedy, {new_tokens} tokens)",
                ["batch", "free tok/s", "constrained tok/s", "constrained / free"],
                [[r["batch"], f"{r['free_tok_s']:.0f}", f"{r['constrained_tok_s']:.0f}", f"{r['ratio']:.3f}"] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
