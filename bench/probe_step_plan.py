"""The host's cost of a step's slot mapping (engine/runner/step_inputs.py `slot_mapping`, part of
every step's plan) against the per-token formula it replaced, measured in one run on this CPU:
per step shape, microseconds per call (best of five repeats) and their ratio. Both lists are
checked equal first. No GPU needed.

    python3 bench/probe_step_plan.py --out /tmp/plan.json
"""

from __future__ import annotations

import argparse
import functools
import timeit

import bench_runtime  # noqa: F401  (puts the repository root on sys.path)
from bench_runtime import write_json

from engine.runner.step_inputs import slot_mapping

BLOCK = 16


def per_token(starts: list[int], ends: list[int], tables: list[list[int]], block_size: int) -> list[int]:
    """The formula token by token (the plan's code before the forty-first session)."""
    return [t[p // block_size] * block_size + p % block_size
            for s, e, t in zip(starts, ends, tables, strict=True) for p in range(s, e)]  # fmt: skip


def shapes(context: int, chunk: int) -> dict[str, tuple[list[int], list[int], list[list[int]]]]:
    """(starts, ends, block tables) of the step shapes bench_engine.py times, and a long prompt."""
    width = -(-(context + 1) // BLOCK)

    def decodes(n: int) -> tuple[list[int], list[int], list[list[int]]]:
        return [context] * n, [context + 1] * n, [list(range(i * width, (i + 1) * width)) for i in range(n)]

    s64, e64, t64 = decodes(64)
    far = 64 * width
    return {
        "decode, 1 row": decodes(1),
        "decode, 64 rows": (s64, e64, t64),
        "decode, 256 rows": decodes(256),
        f"64 decodes + one {chunk}-token chunk": (s64 + [0], e64 + [chunk], t64 + [list(range(far, far + -(-chunk // BLOCK)))]),
        "one 8192-token chunk": ([0], [8192], [list(range(far, far + 8192 // BLOCK))]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each decode sequence")
    p.add_argument("--chunk", type=int, default=512, help="tokens of the mixed step's chunk")
    p.add_argument("--number", type=int, default=200, help="calls per timed repeat")
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for name, (starts, ends, tables) in shapes(args.context, args.chunk).items():
        assert slot_mapping(starts, ends, tables, BLOCK) == per_token(starts, ends, tables, BLOCK), name
        us = {}
        for label, fn in (("per_token_us", per_token), ("slot_mapping_us", slot_mapping)):
            call = functools.partial(fn, starts, ends, tables, BLOCK)
            best = min(timeit.repeat(call, number=args.number, repeat=5))
            us[label] = best / args.number * 1e6
        rows.append({"step": name, "tokens": sum(ends) - sum(starts), **us, "ratio": us["slot_mapping_us"] / us["per_token_us"]})
    print("| step | tokens | per-token formula (us) | slot_mapping (us) | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['step']} | {r['tokens']} | {r['per_token_us']:.1f} | {r['slot_mapping_us']:.1f} | {r['ratio']:.2f} |")
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
