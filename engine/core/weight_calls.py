"""The weight-update control calls of `EngineCore` (engine/weights/updater.py has the rules): from
disk, from tensors and from a process group, each once no request runs (or at once while paused),
then the prefix cache flushed when asked and the version set to the update's `weight_version`; an
update that names none keeps the current one, as SGLang does (the host copy of what was written
refreshes in the background: engine/weights/store.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine.core import calls
from engine.core.deferred import Deferred
from engine.core.rank_protocol import (
    AbortUpdate,
    ApplyUpdate,
    JoinGroup,
    LeaveGroup,
    ValidateUpdate,
)
from engine.memory.regions import RESIDENT

log = logging.getLogger("siesta.engine")

# How a process-group update's tensors travel: one broadcast each, SGLang's flattened bucket, or
# vLLM's packed buckets.
DISTRIBUTED_FORMATS = (None, "flattened_bucket", "packed")


class WeightUpdateCalls:
    """Mixed into EngineCore; uses its updater, availability, memory, scheduler, block_manager and
    runner."""

    def update_weights_from_disk(self, call: calls.UpdateWeightsFromDisk) -> Deferred:
        self.updater.check_path(call.model_path)  # refuse at once, not after the wait
        return self._update_when_idle(call, lambda: self._write(call), call.model_path)

    def update_weights_from_tensor(self, call: calls.UpdateWeightsFromTensor) -> Deferred:
        return self._update_when_idle(call, lambda: self._write(call), "tensors")

    def init_weights_update_group(self, call: calls.InitWeightsUpdateGroup) -> calls.GroupReply:
        """Every rank joins, as rank_offset + its tensor-parallel rank (SGLang's convention)."""
        self.ranks.run(JoinGroup(call))
        last = call.rank_offset + self.ranks.size - 1
        ranks = f"rank {call.rank_offset}" if last == call.rank_offset else f"ranks {call.rank_offset}..{last}"
        return calls.GroupReply(success=True, message=f"joined group {call.group_name!r} as {ranks} of {call.world_size}")

    def update_weights_from_distributed(self, call: calls.UpdateWeightsFromDistributed) -> Deferred:
        if call.load_format not in DISTRIBUTED_FORMATS:  # refuse at once: the trainer must not broadcast
            raise ValueError(f"unknown load_format {call.load_format!r}; valid: null, 'flattened_bucket', 'packed'")

        return self._update_when_idle(call, lambda: self._write(call), f"group {call.group_name!r}")

    def destroy_weights_update_group(self, call: calls.DestroyWeightsUpdateGroup) -> calls.GroupReply:
        self.ranks.run(LeaveGroup(call.group_name))
        return calls.GroupReply(success=True, message=f"left group {call.group_name!r}")

    def update_weight_version(self, call: calls.UpdateWeightVersion) -> calls.VersionReply:
        """Outputs from here on carry `new_version`; requests aborted first when asked."""
        if call.abort_all_requests:
            self.pending += self.abort(None, "aborted by update_weight_version (abort_all_requests)")
        self.availability.weight_version = version = str(call.new_version)
        return calls.VersionReply(success=True, message=f"weight version updated to {version}", new_version=version)

    def _write(self, call: WeightUpdate) -> str | None:
        """Every rank validates the update against its own slice of the model before any rank
        writes a byte (one rank's bad tensor: nothing written anywhere); then every rank writes.
        A write that fails on one rank of several makes the written pieces stale on every rank,
        so all of them go back to the old weights (from the host copy). Returns how a
        process-group update's bytes arrived."""
        try:
            self.ranks.run(ValidateUpdate(call))
        except BaseException:
            self.ranks.run(AbortUpdate([]))  # nothing was written: only staged payloads go
            raise
        try:
            done = self.ranks.run(ApplyUpdate(call))
        except BaseException:
            names = call.names if isinstance(call, calls.UpdateWeightsFromDistributed) else None
            self.ranks.run(AbortUpdate(names if self.ranks.size > 1 else []))
            raise
        return done[0]  # rank 0's route; its updater holds the phases the reply reports

    def _update_when_idle(self, call: WeightUpdate, load: Callable[[], Any], source: str) -> Deferred:
        """Run `load` once no request runs (aborting them when asked; at once while paused, as RL
        clients pause before they push); waiting requests queue meanwhile. Weights must be
        resident; kv_cache may be released. A string `load` returns is the receive route."""
        if self.memory.state["weights"] != RESIDENT:
            raise ValueError("weights are released: resume_memory_occupation(['weights']) before updating them")
        if call.abort_all_requests:
            self.pending += self.abort(None, "aborted by a weight update (abort_all_requests)")
        availability = self.availability
        availability.updating = True

        def run() -> calls.WeightUpdateReply:
            try:
                t0 = time.perf_counter()
                route = load()
                t1 = time.perf_counter()
                if call.flush_cache:
                    # KV of the old weights is never read again, but requests held by an
                    # in_place pause keep theirs on purpose (SGLang's semantics).
                    self.scheduler.drop_kv(keep_running=availability.paused)
                self.updater.phases["flush"] = time.perf_counter() - t1
                if call.weight_version is not None:
                    availability.weight_version = str(call.weight_version)
            finally:
                availability.updating = False
            seconds = time.perf_counter() - t0
            log.info("weights updated from %s in %.1f ms: version %s", source, seconds * 1e3, availability.weight_version)
            return calls.WeightUpdateReply(
                success=True, message=f"weights updated from {source}", weight_version=availability.weight_version,
                seconds=seconds, seconds_by_phase=dict(self.updater.phases), tags=dict(self.memory.state),
                weights_valid=availability.weights_valid, receive_route=route if isinstance(route, str) else None,
            )

        def ready() -> bool:
            return availability.paused or self.scheduler.num_running == 0

        return Deferred(ready=ready, run=run)


WeightUpdate = calls.UpdateWeightsFromDisk | calls.UpdateWeightsFromTensor | calls.UpdateWeightsFromDistributed

