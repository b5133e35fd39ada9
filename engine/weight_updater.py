"""`WeightUpdater`: new weights from an RL trainer, by the three routes SGLang's clients use:
from a checkpoint on disk, from tensors (CUDA IPC handles or shared memory), and broadcast over a
process group the trainer joins.

Rules:
- Every update goes through the startup loader (engine/weights.py): all names, shapes and dtypes
  are validated before the first byte is copied, and each parameter is filled in place, so the
  addresses captured CUDA graphs hold stay valid. A bad update leaves the old weights in use.
- Disk updates read only below the allowed directories (default: the parent of --model); a path
  that resolves elsewhere (`..`, absolute paths, symlinks out) is refused with PermissionError.
- After an update the pinned host copy is refreshed, so a later release/resume keeps the new
  weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.config import EngineConfig
from engine.weights import load_checkpoint, load_named_tensors


def allowed_dirs(config: EngineConfig) -> list[str]:
    """Real paths of the directories disk updates may read below."""
    if config.allowed_model_dirs:
        dirs = [d for d in config.allowed_model_dirs.split(",") if d.strip()]
    else:
        dirs = [os.path.dirname(os.path.realpath(config.model))]
    return [os.path.realpath(d.strip()) for d in dirs]


class WeightUpdater:
    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.allowed = allowed_dirs(config)
        self._groups: Any = None  # engine.weight_group.WeightUpdateGroups, made on first use

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

    def from_disk(self, model_path: str) -> None:
        load_checkpoint(self.model, self.check_path(model_path))

    def from_tensor(self, serialized_named_tensors: list[str], load_format: str | None) -> int:
        from engine.weight_sync import decode_update

        pairs = decode_update(serialized_named_tensors, load_format)
        load_named_tensors(self.model, pairs, require_all=False)
        return len(pairs)

    @property
    def groups(self) -> Any:
        if self._groups is None:
            from engine.weight_group import WeightUpdateGroups

            self._groups = WeightUpdateGroups()
        return self._groups

    def init_group(self, **kwargs: Any) -> None:
        self.groups.init(device=self.device, **kwargs)

    def from_distributed(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        pairs = self.groups.receive(group_name, names, dtypes, shapes, self.device)
        load_named_tensors(self.model, pairs, require_all=False)
        return len(pairs)

    def destroy_group(self, group_name: str) -> None:
        self.groups.destroy(group_name)
