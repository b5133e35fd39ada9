"""The weight-update control calls of `EngineCore` (engine/weights/updater.py has the rules): from
disk, from tensors and from a process group, each once no request runs (or at once while paused),
then the prefix cache flushed when asked and the version bumped (the host copy of what was written
refreshes in the background: engine/weights/store.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.core.deferred import Deferred
from engine.memory.regions import RESIDENT

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler

log = logging.getLogger("siesta.engine")

# How a process-group update's tensors travel: one broadcast each, or SGLang's flattened bucket.
DISTRIBUTED_FORMATS = (None, "flattened_bucket")


class WeightUpdateCalls:
    """Mixed into EngineCore; uses its updater, memory, scheduler, block_manager and runner."""

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None,
    ) -> Deferred:
        self.updater.check_path(model_path)  # refuse at once, not after the wait
        return self._update_when_idle(
            lambda: self.updater.from_disk(model_path), abort_all_requests, flush_cache, weight_version, model_path
        )

    def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None,
    ) -> Deferred:
        return self._update_when_idle(
            lambda: self.updater.from_tensor(serialized_named_tensors, load_format),
            abort_all_requests, flush_cache, weight_version, "tensors",
        )

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
    ) -> dict[str, Any]:
        self.updater.init_group(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend,
        )
        return {"success": True, "message": f"joined group {group_name!r} as rank {rank_offset} of {world_size}"}

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str = "weight_update_group",
        flush_cache: bool = True, abort_all_requests: bool = False, weight_version: str | None = None,
        load_format: str | None = None,
    ) -> Deferred:
        if load_format not in DISTRIBUTED_FORMATS:  # refuse at once: the trainer must not broadcast
            raise ValueError(f"unknown load_format {load_format!r}; valid: null, 'flattened_bucket'")

        def load() -> dict[str, str]:
            self.updater.from_distributed(group_name, names, dtypes, shapes, load_format)
            return {"receive_route": self.updater.route}

        return self._update_when_idle(load, abort_all_requests, flush_cache, weight_version, f"group {group_name!r}")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        self.updater.destroy_group(group_name)
        return {"success": True, "message": f"left group {group_name!r}"}

    def _update_when_idle(
        self, load: Callable[[], Any], abort: bool, flush: bool, version: str | None, source: str
    ) -> Deferred:
        """Run `load` once no request runs (aborting them when asked; at once while paused, as RL
        clients pause before they push). Weights must be resident; kv_cache may be released. A
        dict `load` returns joins the answer."""
        if self.memory.state["weights"] != RESIDENT:
            raise ValueError("weights are released: resume_memory_occupation(['weights']) before updating them")
        if abort:
            self.pending += self.abort(None)
        self.scheduler.admitting = False

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            extra = load()
            t1 = time.perf_counter()
            if flush:
                self.block_manager.reset_prefix_cache()
            self.updater.phases["flush"] = time.perf_counter() - t1
            self.weight_version = version if version is not None else _next_version(self.weight_version)
            seconds = time.perf_counter() - t0
            log.info("weights updated from %s in %.1f ms: version %s", source, seconds * 1e3, self.weight_version)
            return {"success": True, "message": f"weights updated from {source}", "weight_version": self.weight_version,
                    "seconds": seconds, "seconds_by_phase": dict(self.updater.phases),
                    "tags": dict(self.memory.state), "weights_valid": self.weights_valid,
                    **(extra if isinstance(extra, dict) else {})}

        def ready() -> bool:
            return self.paused or self.scheduler.num_running == 0

        return Deferred(ready=ready, run=_restoring_admission(self.scheduler, run))


def _next_version(version: str) -> str:
    """The version after `version` when an update names none: integers count up from 1."""
    return str(int(version) + 1) if version.isdigit() else "1"


def _restoring_admission(scheduler: Scheduler, run: Callable[[], Any]) -> Callable[[], Any]:
    """`run`, with the scheduler admitting again whether it succeeds or fails."""

    def wrapped() -> Any:
        try:
            return run()
        finally:
            scheduler.admitting = True

    return wrapped
