"""Siesta's Triton kernels, each with its launcher (docs/KERNELS.md maps them). Only CUDA code
paths import the kernel modules (they import Triton); this package's root imports nothing of
them, so a CPU install never needs Triton.

Rules: a kernel module knows tensors, shapes and dtypes, never a module's attribute names (its
callers in engine/models/, engine/decode/, engine/attention/ and engine/runner/ pass tensors);
each has a test (tests/test_*.py naming it), and the ones a step spends its time in a
benchmark (bench/kernels/; docs/KERNELS.md lists both).

`SWITCHES`: the three choices that live below any model (`--pdl`, `--fast-launch`,
`--splitk-linear`), set once per process at startup by `configure` (the model runner, from
`EngineConfig`) and read where a kernel is built or launched.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Switches:
    pdl: bool = True  # pdl.py: programmatic dependent launch on compute capability >= 9
    fast_launch: bool = True  # launcher.py: repeat launches skip Triton's JIT path
    splitk_linear: bool = True  # splitk_linear.py: split-K partial sums for few-row row-parallel linears


SWITCHES = Switches()


def configure(pdl: bool, fast_launch: bool, splitk_linear: bool) -> None:
    """The process's kernel switches (before the model is built: kernels read them then)."""
    SWITCHES.pdl, SWITCHES.fast_launch, SWITCHES.splitk_linear = pdl, fast_launch, splitk_linear
