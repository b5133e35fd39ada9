"""The weight checker of `EngineCore`, as SGLang's `/weights_checker`: an RL trainer checks that a
weight sync wrote every tensor (slime's `--check-weight-update-equal`: snapshot and reset_tensors
at startup, the sync, then compare).

Rules (the tensors are the model's state dict: parameters and persistent buffers; rotary tables
are rebuilt from the config, never synced, and left out):
- `snapshot`: a host copy of every tensor, kept until the next snapshot.
- `reset_tensors`: every tensor refilled with random values (floats uniform in [0, 1), as SGLang),
  the pinned host copy refreshed with them (so a release/resume before the sync cannot bring the
  old weights back and hide a tensor the sync missed) and the prefix cache flushed when idle.
  Generation goes on, with garbage, until the next weight update.
- `compare`: every tensor against the snapshot, bit for bit; a mismatch is a failure naming the
  tensors, with their largest and mean absolute differences.
- `checksum`: a 64-bit BLAKE2b of each tensor's bytes, SHA-256 over them in name order
  (`per_gpu_checksum`), as SGLang's answer shape (one rank).
- Weights must be resident: with the `weights` tag released every action is refused.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import torch

from engine.core import calls
from engine.memory.regions import RESIDENT

log = logging.getLogger("siesta.engine")

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
# Tensors named in a compare failure's message, at most.
MAX_NAMED = 20


class WeightCheckFailed(ValueError):
    """`compare` found tensors that differ from the snapshot (HTTP 400, as SGLang)."""


class WeightCheckCalls:
    """Mixed into EngineCore; uses its runner (model, host copy), memory and block_manager."""

    _weight_snapshot: dict[str, torch.Tensor] | None = None

    def check_weights(self, call: calls.CheckWeights) -> dict[str, Any]:
        action = call.action
        if action not in ACTIONS:
            raise ValueError(f"unknown weights_checker action {action!r}; use one of {', '.join(ACTIONS)}")
        if self.ranks.size > 1:  # rank 0 alone would check (or reset) only its own slices
            raise ValueError("the weights checker runs at tp_size 1 only; this engine has tp_size "
                             f"{self.ranks.size}")
        if self.memory.state["weights"] != RESIDENT:
            raise ValueError("weights are released: resume_memory_occupation(['weights']) before checking them")
        if not self.availability.weights_valid:
            raise ValueError("weights were released without a host copy (--weights-backup none): update them first")
        t0 = time.perf_counter()
        answer = getattr(self, f"_weights_{action}")()
        log.info("weights_checker %s in %.1f ms: %s", action, (time.perf_counter() - t0) * 1e3, answer["message"])
        return {"success": True} | answer

    def _checked_tensors(self) -> dict[str, torch.Tensor]:
        self.runner.weights.ensure_current()  # stale pieces come back before anyone reads them
        return dict(self.runner.model.state_dict())

    def _weights_snapshot(self) -> dict[str, Any]:
        tensors = self._checked_tensors()
        self._weight_snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in self._weight_snapshot.values())
        return {"message": f"snapshot of {len(tensors)} tensors ({nbytes / (1 << 20):.1f} MiB) kept on the host"}

    @torch.no_grad()
    def _weights_reset_tensors(self) -> dict[str, Any]:
        tensors = self._checked_tensors()
        self.runner.weights.before_write()
        for t in {id(t): t for t in tensors.values()}.values():  # tied tensors once
            t.copy_(_random_like(t))
        self.runner.weights.written_all()
        flushed = not self.scheduler.has_unfinished() and self.block_manager.reset_prefix_cache()
        return {"message": f"{len(tensors)} tensors set to random values"
                + ("; prefix cache flushed" if flushed else "")}

    def _weights_compare(self) -> dict[str, Any]:
        if self._weight_snapshot is None:
            raise ValueError("no snapshot to compare with: send {'action': 'snapshot'} first")
        tensors = self._checked_tensors()
        if tensors.keys() != self._weight_snapshot.keys():
            raise WeightCheckFailed("the model's tensors are not the snapshot's: "
                                    f"{sorted(tensors.keys() ^ self._weight_snapshot.keys())[:MAX_NAMED]}")
        bad = []
        for name, t in tensors.items():
            want = self._weight_snapshot[name]
            got = t.detach().to("cpu")
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append(_difference(name, want, got))
        if bad:
            more = f" (and {len(bad) - MAX_NAMED} more)" if len(bad) > MAX_NAMED else ""
            raise WeightCheckFailed(f"{len(bad)} of {len(tensors)} tensors differ from the snapshot: "
                                    + "; ".join(bad[:MAX_NAMED]) + more)
        return {"message": f"all {len(tensors)} tensors equal the snapshot"}

    def _weights_checksum(self) -> dict[str, Any]:
        checksums = {name: _hash_tensor(t) for name, t in self._checked_tensors().items()}
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        rank = {
            "checksums": checksums,
            "per_gpu_checksum": overall.hexdigest(),
            "parallelism_info": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                 "pp_size": 1, "rank": 0, "size": 1},
        }
        engine = hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        return {"message": f"checksums of {len(checksums)} tensors", "ranks": [rank], "per_engine_checksum": engine}


def _difference(name: str, want: torch.Tensor, got: torch.Tensor) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype}{list(got.shape)} vs snapshot {want.dtype}{list(want.shape)}"
    diff = (got.double() - want.double()).abs()
    return f"{name}: max_abs_err={diff.max().item():.3g} mean_abs_err={diff.mean().item():.3g}"


def _hash_tensor(t: torch.Tensor) -> str:
    data = t.detach().contiguous().to("cpu").view(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, device=t.device, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, device=t.device) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, device=t.device, dtype=t.dtype)
