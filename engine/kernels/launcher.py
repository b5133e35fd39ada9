"""Triton kernel launches with less host work per call, for the kernels that eager steps launch
(prefill and mixed steps: three attention kernels per layer, outside any graph; the sampler's
kernel every step). Only CUDA code paths import this module (it imports Triton).

Triton's `kernel[grid](*args)` binds the arguments, derives their specialization, turns the
options into a string for its cache key, builds launch metadata for its (empty) hook chain,
checks the kernel's globals and looks up the device and stream before the driver launch. On the
H200 machine's host an attention launch took 19-29 us that way (43-47 in a slower process); the
binding is 3.4 us of it and the compiled kernel's own launcher 5.7. A 28-layer mixed step makes
84 such launches (bench/history/2026-11-24.md).

`Launcher(jit_fn)` keeps the call syntax, `launcher[grid](*args, **kwargs)`. Rules:
- The key is Triton's own specialization of the arguments (its native binder: dtypes, 16-byte
  alignment of pointers, the classes of integers it specializes), the launch options as given and
  the device. Equal keys are the same compiled variant, by Triton's own definition.
- A key seen before launches that variant's launcher directly on the current stream; launch
  attributes compiled into it (cooperative grid, PDL) come with its packed metadata.
- A new key goes through Triton's JIT path (compiles or loads the variant, launches it) and keeps
  the compiled kernel it returns. So does every call while a launch hook or a pre-run hook is set
  (profilers, tools).
- Where this Triton's internals differ from what the rules need (another version), every call
  takes the JIT path: slower, never wrong.
Attribute access falls through to the JIT function (`device_caches`, `warmup`, ...).

Recording (`record_launches()`): while it is open, each launch also appends a `RecordedLaunch`
(the compiled variant, its grid, the stream and every bound argument), or None where the launch
had no compiled variant to keep (a hook set, another Triton). A recorded launch relaunches with
some arguments replaced (`relaunch`): how a step's attention runs its later layers with the
launches of its first (engine/attention/layer_replay.py). The caller owns the rule that the
replaced arguments specialize as the recorded ones did.

`--no-fast-launch` (engine/kernels SWITCHES.fast_launch) sends every launch down Triton's JIT path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from triton.runtime import driver
from triton.runtime.jit import JITFunction

from engine.kernels import SWITCHES

try:
    from triton import knobs
except ImportError:  # Triton before 3.4: every launch takes the JIT path
    knobs = None

Grid = tuple[int, ...]


@dataclass(frozen=True)
class RecordedLaunch:
    """One launch of a compiled variant: grid (3-D), stream and its bound arguments in order."""

    kernel: Any  # triton.compiler.CompiledKernel
    grid: tuple[int, int, int]
    stream: int
    values: tuple[Any, ...]  # every parameter's value, constexprs included, as Triton's binder bound them

    def relaunch(self, values: list[Any]) -> None:
        """Launch the same variant, grid and stream with `values` (the recorded ones, some replaced)."""
        k, (gx, gy, gz) = self.kernel, self.grid
        k.run(gx, gy, gz, self.stream, k.function, k.packed_metadata, None, None, None, *values)


_recording: list[RecordedLaunch | None] | None = None  # the open record_launches() list, if any


@contextlib.contextmanager
def record_launches() -> Iterator[list[RecordedLaunch | None]]:
    """Every Launcher launch made inside the block, in order (None: one that cannot be relaunched)."""
    global _recording
    outer, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = outer


class Launcher:
    """A Triton JIT function whose repeat launches skip the JIT path's host work."""

    def __init__(self, fn: JITFunction) -> None:
        self.fn = fn
        self._compiled: dict[tuple, Any] = {}  # key -> triton.compiler.CompiledKernel
        self._fast = knobs is not None and hasattr(fn, "device_caches")
        self.hits = 0  # launches that skipped the JIT path (tests, bench)
        self.misses = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fn, name)

    def variants(self) -> int:
        """Compiled variants of this kernel in the process, on every device (Triton's own count)."""
        return sum(len(cache[0]) for cache in self.fn.device_caches.values())

    def __getitem__(self, grid: Grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Grid, args: tuple, kwargs: dict[str, Any]) -> None:
        key = None
        if self._fast and SWITCHES.fast_launch and not _hooks_set() and not getattr(self.fn, "pre_run_hooks", None):
            # The options the JIT path adds before it binds, so both paths key the same variant.
            kwargs["debug"] = kwargs.get("debug", self.fn.debug) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            device = driver.active.get_current_device()
            try:
                bound, specialization, options = self.fn.device_caches[device][4](*args, **kwargs)
                key = (device, tuple(specialization), tuple(options.items()))
            except (IndexError, TypeError, ValueError):  # another Triton's binder
                self._fast = False
            kernel = self._compiled.get(key) if key is not None else None
            if kernel is not None:
                self.hits += 1
                g = grid + (1,) * (3 - len(grid))
                stream = driver.active.get_current_stream(device)
                kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *bound.values())
                if _recording is not None:
                    _recording.append(RecordedLaunch(kernel, (g[0], g[1], g[2]), stream, tuple(bound.values())))
                return
        self.misses += 1
        kernel = self.fn[grid](*args, **kwargs)
        if key is not None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            self._compiled[key] = kernel
        if _recording is not None:
            _recording.append(None)  # the JIT path's launch: relaunched only once it is a known variant


def _hooks_set() -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps an always-present, possibly empty chain)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))
