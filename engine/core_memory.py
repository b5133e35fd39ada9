"""The memory-occupation control calls of `EngineCore` (engine/memory.py has the rules): release
once no request runs, resume in any order, and say where every tag stands."""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.deferred import Deferred
from engine.memory import check_tags

log = logging.getLogger("siesta.engine")


class MemoryCalls:
    """Mixed into EngineCore; uses its memory, scheduler, block_manager, runner and pending."""

    def release_memory_occupation(self, tags: list[str] | None = None, mode: str = "wait") -> Deferred:
        """Release `tags` (None or []: all) once no request runs. `wait` lets in-flight requests
        finish; `abort` ends them with finish_reason abort. New requests are refused meanwhile.
        Requests held by a paused engine are retracted (they recompute after resume)."""
        names = check_tags(tags)
        if mode not in ("wait", "abort"):
            raise ValueError(f"unknown release mode {mode!r}; use wait or abort")
        self.draining = True
        self.scheduler.admitting = False
        if mode == "abort":
            self.pending += self.abort(None)
        elif self.paused:
            self.scheduler.retract_all()
        return Deferred(ready=lambda: self.scheduler.num_running == 0, run=lambda: self._release(names))

    def _release(self, tags: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.draining = False
        self.scheduler.admitting = True
        if "kv_cache" in tags:
            self.block_manager.reset_prefix_cache()  # the KV it indexes is about to be lost
        change = self.memory.release(tags)
        changed, freed = change.changed, change.bytes
        if "weights" in changed and self.memory.enabled and self.runner.host_weights is None:
            self.weights_valid = False
        seconds = time.perf_counter() - t0
        log.info("released %s: %.1f MiB freed in %.1f ms", changed or "nothing", freed / (1 << 20), seconds * 1e3)
        return self._memory_answer(changed) | {
            "bytes_freed": freed, "seconds": seconds, "seconds_by_tag": change.seconds_by_tag,
        }

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        change = self.memory.resume(check_tags(tags))
        changed, restored = change.changed, change.bytes
        restore_s = 0.0
        if "weights" in changed and self.runner.host_weights is not None:
            restore_s = self.runner.host_weights.restore()
        seconds = time.perf_counter() - t0
        log.info("resumed %s: %.1f MiB in %.1f ms", changed or "nothing", restored / (1 << 20), seconds * 1e3)
        return self._memory_answer(changed) | {
            "bytes_restored": restored, "seconds": seconds, "seconds_by_tag": change.seconds_by_tag,
            "weights_restore_seconds": restore_s,
        }

    def memory_occupation(self) -> dict[str, Any]:
        host = self.runner.host_weights
        return self.memory.describe() | {
            "weights_backup": self.config.weights_backup,
            "weights_host_copy_bytes": host.nbytes if host else 0,
            "weights_valid": self.weights_valid,
        }

    def _memory_answer(self, changed: list[str]) -> dict[str, Any]:
        return {
            "tags": dict(self.memory.state),
            "changed": changed,
            "memory_saver": self.memory.enabled,
            "weights_valid": self.weights_valid,
        }
