"""The trainer's side of vLLM's NCCL weight transfer, as vLLM's own code does it, for tests that
have no vLLM: `NCCLWeightTransferEngine.trainer_init` and `trainer_send_weights`
(vllm/distributed/weight_transfer/nccl_engine.py), with what they call:
`StatelessProcessGroup.create` and `broadcast_obj` (vllm/distributed/utils.py),
`PyNcclCommunicator.__init__` (vllm/distributed/device_communicators/pynccl.py: the unique id
through the store, ncclCommInitRank, a warm-up all-reduce; NCCL through
engine/weights/nccl_lib.py, as PyNccl goes through its ctypes wrapper) and `packed_nccl_broadcast_producer`
(vllm/distributed/weight_transfer/packed_tensor.py: buckets that close once past 1 GiB).

The unique id is pickled as vLLM pickles it: its ncclUniqueId struct is registered under
vLLM's module path (`unique_id_class`), so the bytes in the store name vLLM's class."""

from __future__ import annotations

import ctypes
import pickle
import socket
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.weights import nccl_lib

PYNCCL_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"
PACKED_BUFFER_SIZE_BYTES = 1 << 30  # DEFAULT_PACKED_BUFFER_SIZE_BYTES


def unique_id_class(path: str = PYNCCL_WRAPPER) -> type[ctypes.Structure]:
    """pynccl_wrapper.ncclUniqueId, importable under `path` (vLLM's module) in this process."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = sys.modules[path]
    if not hasattr(module, "ncclUniqueId"):

        class ncclUniqueId(ctypes.Structure):  # noqa: N801  (vLLM's name)
            _fields_ = [("internal", ctypes.c_byte * 128)]

        ncclUniqueId.__module__, ncclUniqueId.__qualname__ = path, "ncclUniqueId"
        module.ncclUniqueId = ncclUniqueId
    return module.ncclUniqueId


def pickled_unique_id(raw: bytes, path: str = PYNCCL_WRAPPER) -> bytes:
    """What broadcast_obj stores for PyNccl's unique id: pickle.dumps(ncclUniqueId)."""
    cls = unique_id_class(path)
    uid = cls()
    ctypes.memmove(ctypes.addressof(uid), raw, len(raw))
    return pickle.dumps(uid)


def stateless_store(host: str, port: int, world_size: int, timeout_s: float = 300) -> dist.TCPStore:
    """StatelessProcessGroup.create for rank 0: a bound listening socket, then the store's master
    on it (libuv off). Blocks until world_size - 1 clients have joined. The store owns the socket
    (detached here: Python closing it under the store's daemon would abort the process)."""
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind((host, port))
    listen.listen()
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          use_libuv=False, master_listen_fd=listen.detach())
    return store


@dataclass
class VllmTrainer:
    """What trainer_init returns: rank 0's communicator (and the store it keeps)."""

    comm: Any
    store: dist.TCPStore
    device: torch.device


def trainer_init(master_address: str, master_port: int, world_size: int, device: torch.device) -> VllmTrainer:
    """NCCLWeightTransferEngine.trainer_init: rank 0 hosts the store, publishes its NCCL id as
    broadcast_obj does (key "broadcast_from/0/0"), joins the communicator, warms it up."""
    store = stateless_store(master_address, master_port, world_size)
    with torch.cuda.device(device):
        raw = nccl_lib.unique_id()
        store.set("broadcast_from/0/0", pickled_unique_id(raw))
        comm = nccl_lib.init_rank(world_size, raw, 0, device)
        warm = torch.zeros(1, device=device)
        nccl_lib.all_reduce(comm, warm, torch.cuda.current_stream(device))
        torch.cuda.current_stream(device).synchronize()
    return VllmTrainer(comm, store, device)


def _packed(pairs: list[tuple[str, torch.Tensor]], buffer_size_bytes: int) -> Iterator[torch.Tensor]:
    """pack_tensors' buckets: uint8 bytes back to back, a bucket closing once past the size."""
    bucket: list[torch.Tensor] = []
    size = 0
    for _, t in pairs:
        flat = t.contiguous().view(torch.uint8).view(-1)
        bucket.append(flat)
        size += flat.numel()
        if size > buffer_size_bytes:
            yield torch.cat(bucket)
            bucket, size = [], 0
    if bucket:
        yield torch.cat(bucket)


def trainer_send_weights(trainer: VllmTrainer, pairs: list[tuple[str, torch.Tensor]], packed: bool = False,
                         buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES) -> None:
    """NCCLWeightTransferEngine.trainer_send_weights (src 0): each tensor, or packed buckets."""
    with torch.cuda.device(trainer.device):
        sends = _packed(pairs, buffer_size_bytes) if packed else (t.contiguous() for _, t in pairs)
        for t in sends:
            nccl_lib.broadcast(trainer.comm, t, 0, torch.cuda.current_stream(trainer.device))
        torch.cuda.current_stream(trainer.device).synchronize()
