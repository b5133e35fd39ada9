"""A benchmark run with engine constants set first: the in-engine A/B of a constant (a tile width,
a row limit, a measured threshold) without editing the tree, rounds interleaved in one call.

    python3 bench/probes/with_knobs.py --set engine.decode.rules.MAX_HIDDEN=4096 -- \\
        bench/bench_engine.py --shape 30b-a3b --decode-batch-sizes 1 --out $OUT/e.json
    python3 bench/probes/with_knobs.py \\
        --set "engine.kernels.moe_tiles.SPARSE_TILES=(16, 16, 64, 128, 4, 4)" -- bench/bench_engine.py ...

Each `--set NAME=VALUE` imports NAME's module and sets the attribute to VALUE, a Python literal,
before the script runs (as `__main__`, its directory first on sys.path, the arguments after
`--`). Rules:
- A name that does not exist is refused, so a typo cannot measure the default.
- Only this process sees it: an engine the script runs in-process (bench_engine.py,
  bench_deterministic.py, the kernel benches), not a server's child process.
- A module that copied the constant at import (`from m import C`) keeps its copy: set it where it
  is read.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import runpy
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="module.attribute=Python literal, set before the script runs (repeatable)")
    p.add_argument("script", help="the benchmark to run, e.g. bench/bench_engine.py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    return p.parse_args(argv)


def apply(setting: str) -> tuple[str, object, object]:
    """Set one `module.attribute=literal`; returns (name, old value, new value)."""
    name, sep, text = setting.partition("=")
    module_name, _, attr = name.strip().rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"--set {setting!r}: want module.attribute=value")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"--set {setting!r}: {module_name} has no {attr}")
    old, new = getattr(module, attr), ast.literal_eval(text.strip())
    setattr(module, attr, new)
    return name.strip(), old, new


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [os.path.dirname(os.path.abspath(args.script)), root]
    for setting in args.set:
        name, old, new = apply(setting)
        print(f"with_knobs: {name} = {new!r} (was {old!r})", flush=True)
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    sys.argv = [args.script, *script_args]
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
