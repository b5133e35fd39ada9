"""`MemoryRegions`: the engine's GPU memory in three tagged regions that can be handed back to the
driver and taken again at the same virtual addresses (torch_memory_saver), so captured CUDA graphs
replay after a resume without recapture.

Tags (the names RL clients send):
- `weights`: one allocation holding every parameter and buffer (engine/weights/store.py); a pinned
  host copy is kept (`weights_backup="host"`), so release copies nothing, resume only maps pages,
  and the first forward copies back what no weight update has rewritten by then.
- `kv_cache`: KV blocks. Nothing is kept: the prefix cache is flushed with it.
- `cuda_graph`: captured graphs, their pool, their static buffers and the attention workspaces.

Rules:
- Release order kv_cache, weights, cuda_graph; resume order cuda_graph, weights, kv_cache. A tag
  already in the asked state is a no-op, reported as unchanged.
- Release synchronizes the device before pausing (kernels still running on paused memory are an
  illegal access) and empties torch's cache (before pausing: no cudaFree may meet paused memory),
  then synchronizes again before it answers, so the trainer's next allocation finds the memory.
  Bytes freed and restored are measured, not assumed.
- Hook mode: preload (the engine process starts with torch_memory_saver's LD_PRELOAD hook, and
  graphs are captured with `torch_memory_saver.cuda_graph`): it is the library's documented way to
  make graph memory pausable; torch mode would need the region's private MemPool.
- A resume never kills the engine. torch_memory_saver exits the process when cuMemCreate fails,
  so each tag is checked before it is mapped: its bytes plus RESUME_HEADROOM must be free on the
  device (a trainer may still hold memory). A fit with less than RESUME_PROBE_BELOW to spare is
  probed first with a real allocation of its bytes that fails softly (engine/memory/vmm.py). A tag that
  does not fit stays released and is reported with the bytes it needs and the bytes free; the
  others resume. Left open: a trainer that allocates in the microseconds between the probe's
  release and torch_memory_saver's own create.
- On a CPU, or without torch_memory_saver, regions are no-ops and the answers say
  `memory_saver: false` with 0 bytes freed; a release still loses what a GPU release loses: it
  poisons (engine/memory/poison.py) what its tags hold, so a stale read shows in CPU tests. With
  `poison_on_resume` (`--debug-poison-on-resume`) a GPU resume poisons the pages it maps again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.memory.poison import poison_all

log = logging.getLogger("siesta.engine")

TAGS = ("weights", "kv_cache", "cuda_graph")
RELEASE_ORDER = ("kv_cache", "weights", "cuda_graph")
RESUME_ORDER = ("cuda_graph", "weights", "kv_cache")
RESIDENT, RELEASED = "resident", "released"
# Device bytes that must stay free beyond a tag's own for it to resume (the driver's page tables
# and torch's next small allocations).
RESUME_HEADROOM = 64 << 20
# A fit with less than this to spare is probed with a real allocation before it is mapped.
RESUME_PROBE_BELOW = 1 << 30


def check_tags(tags: list[str] | None) -> list[str]:
    """The tags a call names; None or [] means all. Unknown tags raise, listing the valid ones."""
    if not tags:
        return list(TAGS)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"unknown memory tag(s) {', '.join(map(repr, unknown))}; valid tags: {', '.join(TAGS)}")
    return list(dict.fromkeys(tags))


def memory_saver_usable(device: torch.device) -> str | None:
    """None when torch_memory_saver can manage this device's memory, else why not."""
    if device.type != "cuda":
        return "not a CUDA device"
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError(
            "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch_memory_saver cannot "
            "manage: unset it (or pass --no-memory-saver to run without releasable memory)"
        )
    if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
        return "the engine process was started without torch_memory_saver's LD_PRELOAD hook"
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        return "torch_memory_saver is not installed"
    return None


@dataclass(frozen=True)
class RegionChange:
    """What one release or resume did: the tags it changed (in order), the device bytes freed or
    taken (measured), and the driver's seconds per changed tag (pause or resume alone)."""

    changed: list[str]
    bytes: int
    seconds_by_tag: dict[str, float]
    # Tags a resume left released because the device had too little free memory:
    # {tag: {"bytes_needed", "bytes_free"}}.
    refused: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def resume_plan(needed: dict[str, int], free: int, headroom: int = RESUME_HEADROOM) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Which released tags fit in `free` device bytes, taken in resume order: (fitting tags,
    {refused tag: {"bytes_needed", "bytes_free"}}). Each fitting tag uses up its bytes; a tag that
    does not fit is skipped and the next may still fit (weights fit, the KV cache does not)."""
    fitting: list[str] = []
    refused: dict[str, dict[str, int]] = {}
    for tag in RESUME_ORDER:
        if tag not in needed:
            continue
        if needed[tag] + headroom <= free:
            fitting.append(tag)
            free -= needed[tag]
        else:
            refused[tag] = {"bytes_needed": needed[tag], "bytes_free": max(free, 0)}
    return fitting, refused


class MemoryRegions:
    def __init__(self, device: torch.device, enabled: bool, poison_on_resume: bool = False) -> None:
        self.device = device
        why_not = memory_saver_usable(device) if enabled else "disabled by --no-memory-saver"
        self.saver: Any = None
        if why_not is None:
            from torch_memory_saver import torch_memory_saver

            self.saver = torch_memory_saver
        else:
            log.info("memory regions are no-ops: %s", why_not)
        self.state = dict.fromkeys(TAGS, RESIDENT)
        self.bytes = dict.fromkeys(TAGS, 0)  # device memory each region took at startup
        # What each tag holds, for poisoning: callables giving tensors (owners register them).
        self._holdings: dict[str, list[Callable[[], list[torch.Tensor]]]] = {t: [] for t in TAGS}
        # When a tag's contents are poisoned: at release where regions are no-ops (nothing is
        # really lost, so the loss is made), at resume on request (what the driver maps is undefined).
        self.poison_at = "release" if self.saver is None else ("resume" if poison_on_resume else None)

    def holds(self, tag: str, tensors: Callable[[], list[torch.Tensor]]) -> None:
        """`tensors()` lists device tensors that live in `tag`'s region: poisoned when it is lost."""
        self._holdings[tag].append(tensors)

    def _poison(self, tags: list[str]) -> None:
        """Poison what `tags` hold on this device (an owner's host tensors are no region's)."""
        for tag in tags:
            nbytes = poison_all(t for held in self._holdings[tag] for t in held() if t.device.type == self.device.type)
            log.debug("poisoned %s: %d bytes", tag, nbytes)

    @property
    def enabled(self) -> bool:
        return self.saver is not None

    @property
    def released(self) -> list[str]:
        return [t for t in TAGS if self.state[t] == RELEASED]

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Allocations inside belong to `tag`; its size is measured as device memory taken."""
        before = self._free()
        if self.saver is None:
            yield
        else:
            with self.saver.region(tag=tag):
                yield
        self.bytes[tag] += max(before - self._free(), 0)

    def graph_capture(self, graph: torch.cuda.CUDAGraph, pool: Any) -> contextlib.AbstractContextManager:
        """`torch.cuda.graph` whose memory belongs to the cuda_graph region."""
        if self.saver is None:
            return torch.cuda.graph(graph, pool=pool)
        return self.saver.cuda_graph(graph, pool=pool, tag="cuda_graph")

    def release(self, tags: list[str]) -> RegionChange:
        """Pause `tags` (already released ones are skipped)."""
        changed = [t for t in RELEASE_ORDER if t in tags and self.state[t] == RESIDENT]
        self._synchronize()
        before = self._free()
        if self.device.type == "cuda":
            # Cached blocks go back first, so that no cudaFree ever meets paused memory.
            torch.cuda.empty_cache()
        seconds = self._switch(changed, "pause", RELEASED)
        if self.poison_at == "release":
            self._poison(changed)
        self._synchronize()
        return RegionChange(changed, max(self._free() - before, 0), seconds)

    def resume(self, tags: list[str]) -> RegionChange:
        """Take `tags` back (resident ones are skipped); a tag the device has no room for stays
        released and is reported in `refused`."""
        before = self._free()
        fitting, refused = self.plan_resume(tags)
        changed: list[str] = []
        seconds: dict[str, float] = {}
        for tag in fitting:
            if self._probe(tag, refused):
                seconds |= self._switch([tag], "resume", RESIDENT)
                changed.append(tag)
        if self.poison_at == "resume":
            self._poison(changed)
            self._synchronize()
        # Mapping is synchronous: nothing to wait for (a host-copy refresh may be running).
        return RegionChange(changed, max(before - self._free(), 0), seconds, refused)

    def plan_resume(self, tags: list[str]) -> tuple[list[str], dict[str, dict[str, int]]]:
        """`resume_plan` for the released ones of `tags` against the device's free memory now."""
        needed = {t: self.bytes[t] for t in tags if self.state[t] == RELEASED}
        if self.saver is None:  # nothing is really mapped: everything fits
            return [t for t in RESUME_ORDER if t in needed], {}
        return resume_plan(needed, self._free())

    def _probe(self, tag: str, refused: dict[str, dict[str, int]]) -> bool:
        """For a tight fit: can the driver really create the tag's bytes now? (A failed
        create inside torch_memory_saver would exit the process.)"""
        free = self._free()
        need = self.bytes[tag]
        if free - need - RESUME_HEADROOM >= RESUME_PROBE_BELOW:
            return True
        from engine.memory.vmm import CudaDriver

        if need == 0 or CudaDriver(self.device.index or 0).can_allocate(need):
            return True
        refused[tag] = {"bytes_needed": need, "bytes_free": free}
        log.warning("resume of %s refused: the driver could not create %d bytes (%d free)", tag, need, free)
        return False

    def _switch(self, tags: list[str], action: str, state: str) -> dict[str, float]:
        """torch_memory_saver's `pause` or `resume` of each tag, in order; seconds per tag."""
        seconds: dict[str, float] = {}
        for tag in tags:
            t0 = time.perf_counter()
            if self.saver is not None:
                getattr(self.saver, action)(tag)
            seconds[tag] = time.perf_counter() - t0
            self.state[tag] = state
        return seconds

    def describe(self) -> dict[str, Any]:
        free, total = (torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else (0, 0))
        return {
            "memory_saver": self.enabled,
            "hook_mode": "preload" if self.enabled else None,
            "tags": {t: {"state": self.state[t], "bytes": self.bytes[t]} for t in TAGS},
            "device_free_bytes": free,
            "device_total_bytes": total,
        }

    def _free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
