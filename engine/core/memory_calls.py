"""The memory-occupation control calls of `EngineCore` (engine/memory/regions.py has the rules): release
once no request runs, resume in any order, and say where every tag stands."""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.core import calls
from engine.core.deferred import Deferred
from engine.core.rank_protocol import DescribeMemory, PlanResume, ReleaseTags, ResumeTags
from engine.memory.regions import check_tags

log = logging.getLogger("siesta.engine")

# The longest a resume may wait for a trainer to free the device (`wait_for_memory_s`).
MAX_WAIT_FOR_MEMORY_S = 600.0


class MemoryCalls:
    """Mixed into EngineCore; uses its memory, availability, scheduler, block_manager, runner and
    pending."""

    def release_memory_occupation(self, call: calls.ReleaseMemory) -> Deferred:
        """Release `tags` (None or []: all) once no request is left. `wait` lets every accepted
        request (running or queued) finish; `abort` ends them with finish_reason abort. New
        requests are refused meanwhile. Where nothing can run to its end (paused, or a tag
        released already) the requests are retracted and stay queued across the release: they
        recompute once every tag is back and generation continues."""
        names, mode = check_tags(call.tags), call.mode
        if mode not in ("wait", "abort"):
            raise ValueError(f"unknown release mode {mode!r}; use wait or abort")
        availability, scheduler = self.availability, self.scheduler
        availability.draining = True
        if mode == "abort":
            self.pending += self.abort(None, "aborted by a memory release (mode abort)")
        elif not availability.can_step():
            scheduler.retract_all()

        def ready() -> bool:
            return not scheduler.has_unfinished() if availability.can_step() else scheduler.num_running == 0

        return Deferred(ready=ready, run=lambda: self._release(names, call.discard_weights))

    def _release(self, tags: list[str], discard_weights: bool = False) -> calls.ReleaseReply:
        """Every rank pauses the tags (`Rank.release`: the weights' host copy completed first, or
        with `discard_weights` (a level-2 release) freed); the answer counts the device bytes and
        the host bytes every rank freed."""
        t0 = time.perf_counter()
        self.availability.draining = False
        if "kv_cache" in tags:
            self.scheduler.drop_kv()  # the KV is about to be lost: nothing may read it again
        discard = discard_weights and "weights" in tags
        done = self.ranks.run(ReleaseTags(tags, drop_host=discard))
        if discard:
            self.availability.weights_discarded = True  # every piece is stale now: see Availability
        changed, freed = done[0]["changed"], sum(r["bytes"] for r in done)
        host_freed = sum(r["host_bytes_freed"] for r in done)
        seconds = time.perf_counter() - t0
        log.info("released %s: %.1f MiB freed in %.1f ms%s", changed or "nothing", freed / (1 << 20), seconds * 1e3,
                 f", host copy of the weights dropped ({host_freed / (1 << 20):.1f} MiB)" if discard else "")
        return calls.ReleaseReply(
            **self._memory_answer(changed, done), bytes_freed=freed, host_bytes_freed=host_freed, seconds=seconds,
            seconds_by_tag=done[0]["seconds_by_tag"], host_copy_wait_seconds=max(r["host_copy_wait_seconds"] for r in done),
        )

    def resume_memory_occupation(self, call: calls.ResumeMemory) -> calls.ResumeReply | Deferred:
        """Map `tags` (None or []: all) back. A tag the device has no room for (a trainer still
        holds the memory) stays released and is listed in `refused` with the bytes it needs and
        the bytes free; the others resume. With `wait_for_memory_s`, wait up to that long for
        every tag to fit before resuming (other calls are answered meanwhile)."""
        names, wait_for_memory_s = check_tags(call.tags), call.wait_for_memory_s
        early = [t for t in names if t != "weights" and t in self.memory.released]
        discarded = self.availability.discarded() if early else 0
        if discarded:
            raise ValueError(
                f"cannot resume {early}: the weights were discarded by a level-2 sleep and "
                f"{discarded} tensors have not been updated since; resume ['weights'] "
                "(wake_up?tags=weights), update the weights, then resume the rest"
            )
        if not 0.0 <= wait_for_memory_s <= MAX_WAIT_FOR_MEMORY_S:
            raise ValueError(f"wait_for_memory_s must be in [0, {MAX_WAIT_FOR_MEMORY_S:.0f}], got {wait_for_memory_s}")
        if wait_for_memory_s > 0 and self._no_room(names):
            deadline = time.monotonic() + wait_for_memory_s
            return Deferred(
                ready=lambda: time.monotonic() >= deadline or not self._no_room(names),
                run=lambda: self._resume(names),
            )
        return self._resume(names)

    def _no_room(self, tags: list[str]) -> dict[str, dict[str, int]]:
        """The released tags some rank has no room for now: {tag: {bytes_needed, bytes_free}} (the
        first rank's that refused it, with `tp_rank` when there are several)."""
        refused: dict[str, dict[str, int]] = {}
        for rank, found in enumerate(self.ranks.run(PlanResume(tags))):
            for tag, need in found.items():
                refused.setdefault(tag, need | ({"tp_rank": rank} if self.ranks.size > 1 else {}))
        return refused

    def _resume(self, tags: list[str]) -> calls.ResumeReply:
        """Map the tags' pages on every rank, a tag only where every rank has room for it (one
        that a rank's probe refuses after others mapped it is released again there). Weights are
        not copied back here: the first forward restores what no update has written by then
        (engine/weights/store.py)."""
        t0 = time.perf_counter()
        refused = self._no_room(tags) if self.ranks.size > 1 else {}
        done = self.ranks.run(ResumeTags([t for t in tags if t not in refused]))
        for rank, r in enumerate(done):
            for tag, need in r["refused"].items():
                refused.setdefault(tag, need | ({"tp_rank": rank} if self.ranks.size > 1 else {}))
        if self.ranks.size > 1 and any(t in refused for r in done for t in r["changed"]):
            self.ranks.run(ReleaseTags(list(refused)))
        changed = [t for t in done[0]["changed"] if t not in refused]
        restored = sum(r["bytes"] for r in done)
        seconds = time.perf_counter() - t0
        log.info("resumed %s: %.1f MiB in %.1f ms", changed or "nothing", restored / (1 << 20), seconds * 1e3)
        if refused:
            log.warning("resume left %s released: not enough free device memory %s", list(refused), refused)
        return calls.ResumeReply(
            **self._memory_answer(changed, done), success=not refused, refused=refused,
            bytes_restored=restored, seconds=seconds, seconds_by_tag=done[0]["seconds_by_tag"],
        )

    def reset_prefix_cache(self, call: calls.ResetPrefixCache) -> int:
        """Drop every prefix hash; with `reset_running_requests`, every request holding KV is set
        back to recompute it (as after a kv_cache release). Returns how many were set back."""
        if call.reset_running_requests:
            return self.scheduler.drop_kv()
        self.block_manager.forget_prefixes()
        return 0

    def memory_occupation(self, call: calls.GetMemoryOccupation | None = None) -> dict[str, Any]:
        """Rank 0's regions at the top level (as at tp_size 1); with several ranks, each rank's
        under `ranks`. `weights_backup` is the setting (host or none); `weights_host_copy` and
        `weights_host_copy_bytes` what holds the copy now (`discarded`, 0 bytes, from a level-2
        release until an update has written every tensor)."""
        ranks = self.ranks.run(DescribeMemory())
        answer = {k: v for k, v in ranks[0].items() if k not in ("tp_rank", "device")} | {
            "weights_backup": self.config.weights_backup,
            "weights_valid": self.availability.weights_valid,
        }
        return answer | ({"ranks": ranks} if self.ranks.size > 1 else {})

    def _memory_answer(self, changed: list[str], done: list[dict[str, Any]]) -> dict[str, Any]:
        per_rank = [{"tp_rank": i, "bytes": r["bytes"], "changed": r["changed"]}
                    | ({"host_bytes_freed": r["host_bytes_freed"]} if "host_bytes_freed" in r else {})
                    for i, r in enumerate(done)]
        return {
            "tags": dict(self.memory.state),
            "changed": changed,
            "memory_saver": self.memory.enabled,
            "weights_valid": self.availability.weights_valid,
            "weights_stale_bytes": self.runner.weights.stale_bytes,
            "weights_host_copy": self.runner.weights.host_copy_kind,
            "weights_host_copy_bytes": self.runner.weights.host_bytes,
        } | ({"ranks": per_rank} if len(done) > 1 else {})
