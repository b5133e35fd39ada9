"""`Rank`: one tensor-parallel rank's device side: its model runner (weights, KV cache, graphs,
sampler), memory regions and weight updater. Rank 0's `EngineCore` holds one, each worker process
(engine/core/worker.py) another; `Ranks` (engine/core/ranks.py) sends every rank the same message
(engine/core/rank_protocol.py), and `handle` runs it here, dispatched by type.

Rules: a rank decides nothing. What to run, when to release, whether an update goes ahead is rank
0's; a rank answers what its own device did (bytes freed, tags it had no room for, its errors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from engine.config import EngineConfig, ModelConfig
from engine.core import calls
from engine.core import rank_protocol as rp
from engine.memory.regions import RESIDENT
from engine.parallel import TensorParallel, device_for_rank, join_group
from engine.runner.model_runner import ModelRunner, resolve_device
from engine.weights.checker import WeightChecker
from engine.weights.updater import WeightUpdater


class Rank:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tp: TensorParallel, init_method: str,
        store: dist.Store | None = None,
    ) -> None:  # fmt: skip
        """Join the tensor-parallel group (rank 0 with its rendezvous `store`, the others through
        `init_method`; nothing at size 1), then build the runner in step with the other ranks."""
        self.tp = tp
        join_group(tp, resolve_device(device_for_rank(config.device, tp)), init_method, store)
        self.runner = ModelRunner(config, model_config, max_model_len, tp)
        self.memory = self.runner.memory
        self.weights = self.runner.weights
        self.updater = WeightUpdater(self.weights, config, tp)
        self.checker = WeightChecker(self.runner.model, self.weights, tp)

    def handle(self, msg: rp.ToRank) -> Any:
        return _HANDLERS[type(msg)](self, msg)

    def run_step(self, msg: rp.RunStep) -> None:
        self.runner.run(msg.plan)

    # ---- memory ---------------------------------------------------------------------------------

    def release(self, msg: rp.ReleaseTags) -> dict[str, Any]:
        """Pause the tags; with `weights`, the host copy is completed first (or freed, with
        `drop_host`) and every piece goes stale (the first forward after a resume restores what no
        update wrote)."""
        host_wait, host_before = 0.0, self.weights.host_bytes
        drop = msg.drop_host and "weights" in msg.tags
        if "weights" in msg.tags and self.memory.state["weights"] == RESIDENT:  # lost everywhere (a CPU poisons)
            host_wait = self.weights.released(drop_host=drop)
        elif drop:  # released before: every piece is stale already
            host_wait = self.weights.drop_host()
        change = self.memory.release(msg.tags)
        return {"changed": change.changed, "bytes": change.bytes, "seconds_by_tag": change.seconds_by_tag,
                "host_copy_wait_seconds": host_wait, "host_bytes_freed": host_before - self.weights.host_bytes}

    def plan_resume(self, msg: rp.PlanResume) -> dict[str, dict[str, int]]:
        return self.memory.plan_resume(msg.tags)[1]

    def resume(self, msg: rp.ResumeTags) -> dict[str, Any]:
        change = self.memory.resume(msg.tags)
        if "cuda_graph" in change.changed:
            self.runner.after_resume()
        return {"changed": change.changed, "bytes": change.bytes, "seconds_by_tag": change.seconds_by_tag,
                "refused": change.refused}

    def describe(self, msg: rp.DescribeMemory) -> dict[str, Any]:
        store = self.weights
        return self.memory.describe() | {
            "tp_rank": self.tp.rank,
            "device": str(self.runner.device),
            "weights_host_copy": store.host_copy_kind,
            "weights_host_copy_bytes": store.host_bytes,
            "weights_stale_bytes": store.stale_bytes,
            "last_weights_restore": dict(store.last_restore),
            "last_host_copy_refresh": dict(store.last_refresh),
        }

    # ---- weights --------------------------------------------------------------------------------

    def validate_update(self, msg: rp.ValidateUpdate) -> None:
        update, updater = msg.update, self.updater
        if isinstance(update, calls.UpdateWeightsFromDisk):
            updater.validate_disk(update.model_path)
        elif isinstance(update, calls.UpdateWeightsFromTensor):
            updater.stage_tensors(update.serialized_named_tensors, update.load_format)
        else:
            updater.validate_distributed(update.names, update.dtypes, update.shapes)

    def apply_update(self, msg: rp.ApplyUpdate) -> str | None:
        """Write the validated update (the seconds of its phases stay in `updater.phases`); for a
        process-group update, answers how its bytes arrived."""
        update, updater = msg.update, self.updater
        if isinstance(update, calls.UpdateWeightsFromDisk):
            updater.from_disk(update.model_path)
        elif isinstance(update, calls.UpdateWeightsFromTensor):
            updater.from_staged()
        else:
            updater.from_distributed(update.group_name, update.names, update.dtypes, update.shapes, update.load_format)
            return updater.route
        return None

    def abort_update(self, msg: rp.AbortUpdate) -> None:
        self.updater.drop_staged()
        names = msg.names if msg.names is not None else [p.name for p in self.weights.pieces if not p.computed]
        self.weights.invalidate(names)

    def check_weights(self, msg: rp.CheckWeights) -> dict[str, Any]:
        return self.checker.run(msg.action)

    def join_group(self, msg: rp.JoinGroup) -> None:
        c = msg.call
        self.updater.init_group(
            master_address=c.master_address, master_port=c.master_port, rank_offset=c.rank_offset,
            world_size=c.world_size, group_name=c.group_name, backend=c.backend, timeout_s=c.timeout_s,
        )

    def leave_group(self, msg: rp.LeaveGroup) -> None:
        self.updater.destroy_group(msg.group_name)

    def after_reply(self, msg: rp.AfterReply | None = None) -> None:
        self.updater.after_reply()
        self.weights.refresh_host()


_HANDLERS: dict[type, Callable[[Rank, Any], Any]] = {
    rp.RunStep: Rank.run_step,
    rp.ReleaseTags: Rank.release,
    rp.PlanResume: Rank.plan_resume,
    rp.ResumeTags: Rank.resume,
    rp.DescribeMemory: Rank.describe,
    rp.ValidateUpdate: Rank.validate_update,
    rp.ApplyUpdate: Rank.apply_update,
    rp.AbortUpdate: Rank.abort_update,
    rp.CheckWeights: Rank.check_weights,
    rp.JoinGroup: Rank.join_group,
    rp.LeaveGroup: Rank.leave_group,
    rp.AfterReply: Rank.after_reply,
}
