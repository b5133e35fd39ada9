"""The memory-occupation control calls of `EngineCore` (engine/memory/regions.py has the rules): release
once no request runs, resume in any order, and say where every tag stands."""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.core import calls
from engine.core.deferred import Deferred
from engine.memory.regions import RESIDENT, check_tags

log = logging.getLogger("siesta.engine")

# The longest a resume may wait for a trainer to free the device (`wait_for_memory_s`).
MAX_WAIT_FOR_MEMORY_S = 600.0


class MemoryCalls:
    """Mixed into EngineCore; uses its memory, availability, scheduler, block_manager, runner and
    pending."""

    def release_memory_occupation(self, call: calls.ReleaseMemory) -> Deferred:
        """Release `tags` (None or []: all) once no request runs. `wait` lets in-flight requests
        finish; `abort` ends them with finish_reason abort. New requests are refused meanwhile.
        Requests held by a paused engine are retracted (they recompute after resume)."""
        names, mode = check_tags(call.tags), call.mode
        if mode not in ("wait", "abort"):
            raise ValueError(f"unknown release mode {mode!r}; use wait or abort")
        self.availability.draining = True
        if mode == "abort":
            self.pending += self.abort(None)
        elif self.availability.paused:
            self.scheduler.retract_all()
        return Deferred(ready=lambda: self.scheduler.num_running == 0, run=lambda: self._release(names))

    def _release(self, tags: list[str]) -> calls.ReleaseReply:
        t0 = time.perf_counter()
        self.availability.draining = False
        if "kv_cache" in tags:
            self.block_manager.reset_prefix_cache()  # the KV it indexes is about to be lost
        host_wait = 0.0
        if "weights" in tags and self.memory.enabled and self.memory.state["weights"] == RESIDENT:
            host_wait = self.runner.weights.released()  # waits for the host copy; every piece goes stale
        change = self.memory.release(tags)
        changed, freed = change.changed, change.bytes
        seconds = time.perf_counter() - t0
        log.info("released %s: %.1f MiB freed in %.1f ms", changed or "nothing", freed / (1 << 20), seconds * 1e3)
        return calls.ReleaseReply(
            **self._memory_answer(changed), bytes_freed=freed, seconds=seconds, seconds_by_tag=change.seconds_by_tag,
            host_copy_wait_seconds=host_wait,
        )

    def resume_memory_occupation(self, call: calls.ResumeMemory) -> calls.ResumeReply | Deferred:
        """Map `tags` (None or []: all) back. A tag the device has no room for (a trainer still
        holds the memory) stays released and is listed in `refused` with the bytes it needs and
        the bytes free; the others resume. With `wait_for_memory_s`, wait up to that long for
        every tag to fit before resuming (other calls are answered meanwhile)."""
        names, wait_for_memory_s = check_tags(call.tags), call.wait_for_memory_s
        if not 0.0 <= wait_for_memory_s <= MAX_WAIT_FOR_MEMORY_S:
            raise ValueError(f"wait_for_memory_s must be in [0, {MAX_WAIT_FOR_MEMORY_S:.0f}], got {wait_for_memory_s}")
        if wait_for_memory_s > 0 and self.memory.plan_resume(names)[1]:
            deadline = time.monotonic() + wait_for_memory_s
            return Deferred(
                ready=lambda: time.monotonic() >= deadline or not self.memory.plan_resume(names)[1],
                run=lambda: self._resume(names),
            )
        return self._resume(names)

    def _resume(self, tags: list[str]) -> calls.ResumeReply:
        """Map the tags' pages. Weights are not copied back here: the first forward restores
        what no update has written by then (engine/weights/store.py)."""
        t0 = time.perf_counter()
        change = self.memory.resume(tags)
        changed, restored = change.changed, change.bytes
        seconds = time.perf_counter() - t0
        log.info("resumed %s: %.1f MiB in %.1f ms", changed or "nothing", restored / (1 << 20), seconds * 1e3)
        if change.refused:
            log.warning("resume left %s released: not enough free device memory %s", list(change.refused), change.refused)
        return calls.ResumeReply(
            **self._memory_answer(changed), success=not change.refused, refused=change.refused,
            bytes_restored=restored, seconds=seconds, seconds_by_tag=change.seconds_by_tag,
        )

    def memory_occupation(self, call: calls.GetMemoryOccupation | None = None) -> dict[str, Any]:
        store = self.runner.weights
        return self.memory.describe() | {
            "weights_backup": self.config.weights_backup,
            "weights_host_copy_bytes": store.host_bytes,
            "weights_valid": self.availability.weights_valid,
            "weights_stale_bytes": store.stale_bytes,
            "last_weights_restore": dict(store.last_restore),
            "last_host_copy_refresh": dict(store.last_refresh),
        }

    def _memory_answer(self, changed: list[str]) -> dict[str, Any]:
        return {
            "tags": dict(self.memory.state),
            "changed": changed,
            "memory_saver": self.memory.enabled,
            "weights_valid": self.availability.weights_valid,
            "weights_stale_bytes": self.runner.weights.stale_bytes,
        }
