"""The unpickler of weight payloads (engine/weights/payload.py): torch's ForkingPickler pickles of
tensors, read with an allow list.

Rules:
- Only torch's tensor and storage rebuild functions, `torch.Size`, `torch.Tensor`, `Parameter`,
  the storages, torch dtypes, `OrderedDict` and `DupFd` resolve, plus the names the caller adds
  (payload.py: SGLang's classes, under SGLang's module paths or its own). Anything else is an
  UnpicklingError: the usual gadgets are blocked, but this is no sandbox (payload.py, SECURITY).
- CUDA tensors that SGLang's `monkey_patch_torch_reductions` pickled name their device by UUID;
  `rebuild_cuda_tensor_by_uuid` maps the UUID to this process's device index.
- `again`: this process is not the first to read the pickle (a tensor-parallel rank after rank
  0), so each `file_system` CPU storage it rebuilds keeps the sender's count
  (`_rebuild_storage_filename_again`).
"""

from __future__ import annotations

import collections
import io
import pickle
from multiprocessing import resource_sharer
from typing import Any

import torch
from torch.multiprocessing import reductions

_REBUILDS = (
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
    "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_meta_tensor",
)  # fmt: skip
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{("torch.multiprocessing.reductions", n): getattr(reductions, n) for n in _REBUILDS},
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("multiprocessing.resource_sharer", "DupFd"): resource_sharer.DupFd,
}


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patched CUDA rebuild: argument 6 is the device, an index or a device UUID."""
    args_list = list(args)
    if len(args_list) > 6 and isinstance(args_list[6], str):
        uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        if args_list[6] not in uuids:
            raise ValueError(f"tensor is on CUDA device {args_list[6]}, which this process cannot see")
        args_list[6] = uuids.index(args_list[6])
    return reductions.rebuild_cuda_tensor(*args_list)


def _rebuild_storage_filename_again(*args: Any) -> Any:
    """torch's rebuild of a `file_system` CPU storage for a second reader of one pickle. The sender
    counts one reader per pickle (`_shared_incref` as it pickles) and each rebuild gives one back
    (`_shared_decref`). When several tensor-parallel ranks read one payload, the extra readers
    take theirs back, so the count never reaches zero while the sender still holds the tensor.
    At zero, torch's shm manager unlinks the segment, and the sender's next pickle of the same
    tensor would name a file that is gone."""
    storage = reductions.rebuild_storage_filename(*args)
    storage._shared_incref()
    return storage


class PayloadUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed globals and `names` ({name: object}) under one of `modules`
    (a module's name, or a prefix ending in "."); anything else is an UnpicklingError."""

    def __init__(self, file: io.BytesIO, names: dict[str, Any], modules: tuple[str, ...], again: bool = False) -> None:
        super().__init__(file)
        self.names, self.modules, self.again = names, modules, again

    def find_class(self, module: str, name: str) -> Any:
        if self.again and (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return _rebuild_storage_filename_again
        found = ALLOWED_GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self.names and any(module == m or (m.endswith(".") and module.startswith(m)) for m in self.modules):
            return self.names[name]
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a weight payload")
