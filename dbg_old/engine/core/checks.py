"""The weight checker of `EngineCore`, as SGLang's `/weights_checker`: an RL trainer checks that a
weight sync wrote every tensor (slime's `--check-weight-update-equal`: snapshot and reset_tensors
at startup, the sync, then compare).

Every tensor-parallel rank runs the action on the tensors it holds (engine/weights/checker.py says
what each action does); here the call is checked, sent to every rank and the answers joined:
- `reset_tensors` also flushes the prefix cache when idle. Generation goes on, with garbage, until
  the next weight update.
- `compare` fails (HTTP 400) when any rank's tensors differ, naming the rank and the tensors.
- `checksum` answers SGLang's shape: one entry per rank in `ranks` (its tensors' checksums,
  `per_gpu_checksum`, `parallelism_info`) and `per_engine_checksum`, SHA-256 over the ranks'
  `per_gpu_checksum` in rank order.
- Weights must be resident: with the `weights` tag released every action is refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from engine.core import calls
from engine.core.rank_protocol import CheckWeights
from engine.memory.regions import RESIDENT

log = logging.getLogger("siesta.engine")

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")


class WeightCheckCalls:
    """Mixed into EngineCore; uses its ranks, memory, availability, scheduler and block_manager."""

    def check_weights(self, call: calls.CheckWeights) -> dict[str, Any]:
        action = call.action
        if action not in ACTIONS:
            raise ValueError(f"unknown weights_checker action {action!r}; use one of {', '.join(ACTIONS)}")
        if self.memory.state["weights"] != RESIDENT:
            raise ValueError("weights are released: resume_memory_occupation(['weights']) before checking them")
        if not self.availability.weights_valid:
            raise ValueError("weights were released without a host copy (--weights-backup none): update them first")
        t0 = time.perf_counter()
        ranks = self.ranks.run(CheckWeights(action))
        answer = getattr(self, f"_joined_{action}")(ranks)
        log.info("weights_checker %s in %.1f ms: %s", action, (time.perf_counter() - t0) * 1e3, answer["message"])
        return {"success": True} | answer

    def _joined_snapshot(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        mib = sum(r["bytes"] for r in ranks) / (1 << 20)
        return {"message": f"snapshot of {_tensors(ranks)} ({mib:.1f} MiB) kept on the host"}

    def _joined_reset_tensors(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        flushed = not self.scheduler.has_unfinished() and self.block_manager.reset_prefix_cache()
        return {"message": f"{_tensors(ranks)} set to random values" + ("; prefix cache flushed" if flushed else "")}

    def _joined_compare(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        return {"message": f"all {_tensors(ranks)} equal the snapshot"}

    def _joined_checksum(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode()).hexdigest()
        return {"message": f"checksums of {_tensors(ranks)}", "ranks": ranks, "per_engine_checksum": engine}


def _tensors(ranks: list[dict[str, Any]]) -> str:
    """'N tensors', or 'N tensors on each of R ranks'."""
    counts = [r["tensors"] if "tensors" in r else len(r["checksums"]) for r in ranks]
    n = counts[0] if len(set(counts)) == 1 else "/".join(map(str, counts))
    return f"{n} tensors" + (f" on each of {len(ranks)} ranks" if len(ranks) > 1 else "")
