"""`WeightChecker`: one rank's part of SGLang's `/weights_checker` (engine/core/checks.py runs it on
every tensor-parallel rank and joins the answers). Each rank checks the tensors it holds: at
tp_size > 1 those are its shards, named as the model names them.

Rules (the tensors are the model's state dict: parameters and persistent buffers; rotary tables
are rebuilt from the config, never synced, and left out):
- `snapshot`: a host copy of every tensor, kept until the next snapshot.
- `reset_tensors`: every tensor refilled with random values (floats uniform in [0, 1), as SGLang),
  the pinned host copy refreshed with them (so a release/resume before the sync cannot bring the
  old weights back and hide a tensor the sync missed).
- `compare`: every tensor against the snapshot, bit for bit; a mismatch is a failure naming the
  tensors, with their largest and mean absolute differences.
- `checksum`: a 64-bit BLAKE2b of each tensor's bytes, SHA-256 over them in name order
  (`per_gpu_checksum`), with this rank's `parallelism_info`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from engine.parallel import TensorParallel
from engine.weights.store import WeightStore

# Tensors named in a compare failure's message, at most.
MAX_NAMED = 20


class WeightCheckFailed(ValueError):
    """`compare` found tensors that differ from the snapshot (HTTP 400, as SGLang)."""


class WeightChecker:
    def __init__(self, model: nn.Module, weights: WeightStore, tp: TensorParallel) -> None:
        self.model, self.weights, self.tp = model, weights, tp
        self._snapshot: dict[str, torch.Tensor] | None = None

    def run(self, action: str) -> dict[str, Any]:
        """One action (its name checked by the caller); answers what it did on this rank."""
        return getattr(self, action)()

    def tensors(self) -> dict[str, torch.Tensor]:
        self.weights.ensure_current()  # stale pieces come back before anyone reads them
        return dict(self.model.state_dict())

    def snapshot(self) -> dict[str, Any]:
        tensors = self.tensors()
        self._snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in self._snapshot.values())}

    @torch.no_grad()
    def reset_tensors(self) -> dict[str, Any]:
        tensors = self.tensors()
        self.weights.before_write()
        for t in {id(t): t for t in tensors.values()}.values():  # tied tensors once
            t.copy_(_random_like(t))
        self.weights.written_all()
        return {"tensors": len(tensors)}

    def compare(self) -> dict[str, Any]:
        if self._snapshot is None:
            raise ValueError("no snapshot to compare with: send {'action': 'snapshot'} first")
        tensors = self.tensors()
        if tensors.keys() != self._snapshot.keys():
            raise WeightCheckFailed("the model's tensors are not the snapshot's: "
                                    f"{sorted(tensors.keys() ^ self._snapshot.keys())[:MAX_NAMED]}")
        bad = []
        for name, t in tensors.items():
            want = self._snapshot[name]
            got = t.detach().to("cpu")
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append(_difference(name, want, got))
        if bad:
            more = f" (and {len(bad) - MAX_NAMED} more)" if len(bad) > MAX_NAMED else ""
            raise WeightCheckFailed(f"{len(bad)} of {len(tensors)} tensors differ from the snapshot: "
                                    + "; ".join(bad[:MAX_NAMED]) + more)
        return {"tensors": len(tensors)}

    def checksum(self) -> dict[str, Any]:
        checksums = {name: _hash_tensor(t) for name, t in self.tensors().items()}
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        rank, size = self.tp.rank, self.tp.size
        return {
            "checksums": checksums,
            "per_gpu_checksum": overall.hexdigest(),
            "parallelism_info": {"tp_rank": rank, "tp_size": size, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                                 "pp_size": 1, "rank": rank, "size": size},
        }


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
