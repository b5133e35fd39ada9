"""`WeightUpdater`: new weights from an RL trainer, by the three routes SGLang's clients use:
from a checkpoint on disk, from tensors (CUDA IPC handles or shared memory), and broadcast over a
process group the trainer joins (engine/weights/group_updates.py).

Rules:
- Every update goes through the startup loader (engine/weights/loader.py): all names, shapes and dtypes
  are validated before the first byte is copied, and each parameter is filled in place, so the
  addresses captured CUDA graphs hold stay valid. A bad update leaves the old weights in use.
- Disk updates read only below the allowed directories (default: the parent of --model); a path
  that resolves elsewhere (`..`, absolute paths, symlinks out) is refused with PermissionError.
- Every write goes through the weight store (engine/weights/store.py): it waits for a host-copy
  refresh still reading the weights, marks what was written current, and refreshes the host copy
  of those pieces in the background, so a later release/resume keeps the new weights.
- An update answers only once its copies have finished on the device: the trainer may free or
  reuse its tensors (CUDA IPC, shared memory) as soon as it has the answer.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.parallel import TensorParallel
from engine.weights.group_updates import GroupUpdates, _Meta
from engine.weights.loader import (
    load_checkpoint,
    load_named_tensors,
    validate_checkpoint,
    validate_entries,
)
from engine.weights.store import WeightStore


def allowed_dirs(config: EngineConfig) -> list[str]:
    """Real paths of the directories disk updates may read below."""
    if config.allowed_model_dirs:
        dirs = [d for d in config.allowed_model_dirs.split(",") if d.strip()]
    else:
        dirs = [os.path.dirname(os.path.realpath(config.model))]
    return [os.path.realpath(d.strip()) for d in dirs]


class WeightUpdater(GroupUpdates):
    def __init__(self, store: WeightStore, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.store = store
        self.tp = tp or TensorParallel()
        self._staged: list[tuple[str, torch.Tensor]] | None = None  # a payload decoded and validated
        self.model = store.model
        self.device = store.device
        self.allowed = allowed_dirs(config)
        self._groups: Any = None  # engine.weights.groups.WeightUpdateGroups, made on first use
        # Seconds of the last update's phases (receive: decode/open handles or broadcast; copy:
        # into the parameters, to the device's completion), answered with it.
        self.phases: dict[str, float] = {}
        self._last_meta: _Meta | None = None  # the last process-group update's list, validated
        self._leftover: list[torch.Tensor] = []  # the last process-group update's scratch
        self.route = ""  # how the last process-group update's bytes arrived, answered with it

    def check_path(self, model_path: str) -> str:
        """The real path of an allowed checkpoint directory, or PermissionError."""
        real = os.path.realpath(model_path)
        if not any(os.path.commonpath([real, d]) == d for d in self.allowed):
            raise PermissionError(
                f"{model_path!r} is outside the directories weight updates may read ({', '.join(self.allowed)}); "
                "start the server with --allowed-model-dirs DIR[,DIR...] naming a directory above it to allow it"
            )
        if not os.path.isdir(real):
            raise ValueError(f"model_path {model_path!r} is not a directory")
        return real

    def from_disk(self, model_path: str) -> int:
        path = self.check_path(model_path)
        self._start()
        written = load_checkpoint(self.model, path, self.store.targets)
        self._copied()
        return self._done(written)

    def validate_disk(self, model_path: str) -> None:
        """Check a checkpoint's headers against the model (nothing is read but headers)."""
        validate_checkpoint(self.model, self.check_path(model_path), self.store.targets)

    def stage_tensors(self, serialized_named_tensors: list[str], load_format: str | None) -> None:
        """Decode this rank's payload (one per rank, or one for all) and check it against the
        model; `from_staged` writes it."""
        from engine.weights.payload import decode_update

        count = len(serialized_named_tensors) if isinstance(serialized_named_tensors, list) else 0
        if count not in (1, self.tp.size):
            raise ValueError(
                f"serialized_named_tensors has {count} payloads; send one per tensor-parallel rank "
                f"({self.tp.size}) or one for all"
            )
        self._staged = None
        self._start()
        pairs = decode_update(serialized_named_tensors, load_format, self.tp.rank)
        self._phase("receive")
        entries = [(n, tuple(t.shape), t.dtype) for n, t in pairs]
        try:
            validate_entries(self.model, entries, self.store.targets)
        except BaseException:
            del pairs  # a refused push's tensors go now (CUDA IPC handles close), not with its traceback
            raise
        self._staged = pairs

    def from_staged(self) -> int:
        """Write the tensors `stage_tensors` decoded."""
        pairs, self._staged = self._staged, None
        if pairs is None:
            raise RuntimeError("no staged tensors to write")
        written = load_named_tensors(self.model, pairs, require_all=False, targets=self.store.targets)
        self._copied()
        # Close the CUDA IPC handles (or shared memory) now, before the host-copy refresh is
        # queued (after the answer): closing a handle waits for the device.
        del pairs
        self._phase("close_handles")
        return self._done(written)

    def drop_staged(self) -> None:
        """Forget a staged payload (its CUDA IPC handles close)."""
        self._staged = None

    def _start(self) -> None:
        self.phases = {}
        self._t = time.perf_counter()
        self.store.before_write()

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._t
        self._t = now

    def _copied(self) -> None:
        """Wait for the copies into the parameters (the sources may go once the call answers)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._phase("copy")

    def _done(self, written: list[str]) -> int:
        """The store knows what was written (its host copy refreshes after the answer)."""
        self.store.written(written)
        return len(written)
