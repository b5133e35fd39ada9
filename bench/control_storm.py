"""The storm of issue 72 against a real server: 8 prompts of 50 random tokens give the reference
(greedy, 24 new tokens); then, per trial, 40 calls at once from one asyncio client (10 releases,
10 resumes, 10 generates of prompts 0 and 1, 10 flushes), one more resume, and the 8 prompts
again. A trial passes when every generate answered and the 8 prompts after it equal the
reference, token for token. Prints one table (trials passing, answers by status) and writes JSON.
`--no-release` is the control run: 20 info reads in place of the releases and resumes.

    python3 bench/control_storm.py --shape 0.6b --trials 20 --out $OUT/storm.json            # H200
    python3 bench/control_storm.py --shape 0.6b --trials 20 --poison --out $OUT/storm_p.json  # resumes poisoned
    python3 bench/control_storm.py --tiny --trials 2 --out /tmp/storm.json                      # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import sys
import tempfile
from typing import Any

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import elapsed, say, write_json  # noqa: E402
from engine_shapes import checkpoint  # noqa: E402
from report import Rows, print_targets, run_footer  # noqa: E402
from serving_server import Server  # noqa: E402

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


async def _generate(http: httpx.AsyncClient, prompts: list[list[int]]) -> list[list[int]]:
    r = await http.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
    r.raise_for_status()
    return [o["output_ids"] for o in r.json()]


async def _trial(http: httpx.AsyncClient, prompts: list[list[int]], reference: list[list[int]], release: bool) -> dict[str, Any]:
    """The 40 calls at once; the extra resume goes once the control calls are answered (a
    generate queued across a release may wait for it), then the generates are read."""
    if release:
        controls = [http.post("/release_memory_occupation", json={}) for _ in range(10)]
        controls += [http.post("/resume_memory_occupation", json={}) for _ in range(10)]
    else:  # the control run: the same traffic without a release, to see what batch shapes alone change
        controls = [http.get("/get_server_info") for _ in range(20)]
    controls = [asyncio.ensure_future(c) for c in controls]
    gens = [asyncio.ensure_future(http.post("/generate", json={"input_ids": prompts[:2], "sampling_params": GREEDY}))
            for _ in range(10)]
    controls += [asyncio.ensure_future(http.post("/flush_cache")) for _ in range(10)]
    answered = await asyncio.gather(*controls)
    (await http.post("/resume_memory_occupation", json={})).raise_for_status()
    generated = await asyncio.gather(*gens)
    answers = answered[:20] + generated + answered[20:]
    statuses = collections.Counter(f"{kind} {r.status_code}" for kind, r in zip(
        (["release"] * 10 + ["resume"] * 10 if release else ["info"] * 20) + ["generate"] * 10 + ["flush"] * 10,
        answers, strict=True))
    generates = [[o["output_ids"] for o in r.json()] for r in generated if r.status_code == 200]
    after = await _generate(http, prompts)
    return {
        "statuses": dict(statuses),
        "generates_answered": len(generates),
        "generates_wrong": sum(g != reference[:2] for g in generates),
        "rows_wrong_after": [i for i, (a, b) in enumerate(zip(after, reference, strict=True)) if a != b],
        "server_errors": sum(r.status_code >= 500 and r.status_code != 503 for r in answers),
    }


async def _storm(url: str, trials: int, vocab: int, release: bool) -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(50)] for _ in range(8)]
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        reference = await _generate(http, prompts)
        warm = await _generate(http, prompts)  # the same prompts with their prefixes cached
        results = []
        for t in range(trials):
            results.append(await _trial(http, prompts, reference, release))
            r = results[-1]
            say(f"trial {t}: {r['statuses']}, generates wrong {r['generates_wrong']}/{r['generates_answered']}, "
                f"rows wrong after {r['rows_wrong_after']}")
    return {"prompts": prompts, "reference": reference, "warm_equals_reference": warm == reference, "trials": results}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.6b", help="an engine_shapes shape (0.6b, 8b) or a checkpoint directory")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU (a smoke test)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--poison", action="store_true", help="start the server with --debug-poison-on-resume")
    ap.add_argument("--no-release", action="store_true", help="the control run: 20 info reads in place of the releases and resumes")
    ap.add_argument("--flags", default="", help="more `siesta serve` flags, e.g. '--disable-cuda-graph'")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "control_storm.json"))
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    ckpt = checkpoint("tiny" if args.tiny else args.shape, args.model_dir, device, seed=0)
    flags = ["--device", device.type, "--max-model-len", "512"]
    flags += ["--debug-poison-on-resume"] if args.poison else []
    flags += ["--num-kv-blocks", "256"] if device.type == "cpu" else []
    flags += args.flags.split()
    server = Server(ckpt["path"], flags, log_path=os.path.splitext(args.out)[0] + ".server.log")
    try:
        info = server.wait_ready(600)
        res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": info.get("dtype"),
               "shape": ckpt["shape"], "poison_on_resume": args.poison, "flags": flags, "release": not args.no_release,
               "memory_saver": httpx.get(f"{server.url}/memory_occupation").json()["memory_saver"]}
        res |= asyncio.run(_storm(server.url, args.trials, ckpt["shape"]["vocab_size"], not args.no_release))
    finally:
        server.stop()
    trials = res["trials"]
    passed = sum(not t["generates_wrong"] and not t["rows_wrong_after"] and not t["server_errors"] for t in trials)
    res["trials_passed"] = passed
    totals: collections.Counter[str] = collections.Counter()
    for t in trials:
        totals.update(t["statuses"])
    rows = res["table"] = Rows()
    rows.add("trials identical to the reference; ref = trials", passed, len(trials), target="all", ok=passed == len(trials))
    rows.add("generates answered; ref = wrong", sum(t["generates_answered"] for t in trials),
             sum(t["generates_wrong"] for t in trials))
    rows.add("answers by status", str(dict(sorted(totals.items()))))
    rows.add("warm prefix cache gives the reference", res["warm_equals_reference"])
    res["meta"], res["errors"] = {"out": args.out}, {}
    write_json(args.out, res)
    print_targets(f"control storm on {res['device']}: {res['dtype']}, memory saver {res['memory_saver']}, releases "
                  f"{not args.no_release}, flags {' '.join(flags)}", rows, footer=run_footer(res, elapsed()))
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
