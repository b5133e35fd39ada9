"""The NCCL calls a communicator made from someone else's unique id needs, through ctypes on the
libnccl that torch loads (vLLM's and SGLang's PyNccl do the same). torch.cuda.nccl has no use
here: its `init_rank` fails on Python 3.12 (a `#` format without PY_SSIZE_T_CLEAN, torch 2.11).

Rules:
- Every call's ncclResult_t is checked: anything but ncclSuccess raises RuntimeError with NCCL's
  own string.
- A communicator is an opaque pointer (`Comm`); its device is the current device at init.
- Collectives are enqueued on the stream given (a torch.cuda.Stream): they return at once.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

import torch

UNIQUE_ID_BYTES = 128
Comm = ctypes.c_void_p
_DTYPES = {  # ncclDataType_t
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
SUM = 0  # ncclRedOp_t


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "ncclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "ncclGetUniqueId": (ctypes.c_int, [ctypes.POINTER(UniqueId)]),
    "ncclCommInitRank": (ctypes.c_int, [ctypes.POINTER(Comm), ctypes.c_int, UniqueId, ctypes.c_int]),
    "ncclBroadcast": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_int, Comm, ctypes.c_void_p]),
    "ncclAllReduce": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_int, Comm, ctypes.c_void_p]),
    "ncclCommAbort": (ctypes.c_int, [Comm]),
}
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    """libnccl.so.2 as torch loaded it (the same NCCL as ProcessGroupNCCL), else the wheel's."""
    global _lib
    if _lib is None:
        torch.cuda.init()
        candidates = ["libnccl.so.2"] + glob.glob(
            os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib", "libnccl.so*"))
        for name in candidates:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            raise RuntimeError(f"no NCCL library found (tried {', '.join(candidates)})")
        for fn, (restype, argtypes) in _SIGNATURES.items():
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, argtypes
        _lib = lib
    return _lib


def _check(result: int) -> None:
    if result != 0:
        raise RuntimeError(f"NCCL error {result}: {_library().ncclGetErrorString(result).decode()}")


def unique_id() -> bytes:
    uid = UniqueId()
    _check(_library().ncclGetUniqueId(ctypes.byref(uid)))
    return bytes(uid)


def init_rank(world_size: int, uid: bytes, rank: int, device: torch.device) -> Comm:
    """ncclCommInitRank on `device`: blocks until every rank of the communicator has called it."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    comm = Comm()
    with torch.cuda.device(device):
        _check(_library().ncclCommInitRank(ctypes.byref(comm), world_size, UniqueId.from_buffer_copy(uid), rank))
    return comm


def _dtype(t: torch.Tensor) -> int:
    if t.dtype not in _DTYPES or not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"NCCL takes a contiguous CUDA tensor of {sorted(map(str, _DTYPES))}, got {t.dtype} on {t.device}")
    return _DTYPES[t.dtype]


def broadcast(comm: Comm, t: torch.Tensor, root: int, stream: torch.cuda.Stream) -> None:
    """In place: root's `t` lands in every rank's `t` (same numel and dtype everywhere)."""
    ptr = ctypes.c_void_p(t.data_ptr())
    _check(_library().ncclBroadcast(ptr, ptr, t.numel(), _dtype(t), root, comm, ctypes.c_void_p(stream.cuda_stream)))


def all_reduce(comm: Comm, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """In place, summed over the ranks."""
    ptr = ctypes.c_void_p(t.data_ptr())
    _check(_library().ncclAllReduce(ptr, ptr, t.numel(), _dtype(t), SUM, comm, ctypes.c_void_p(stream.cuda_stream)))


def abort(comm: Comm) -> None:
    """Free the communicator now, ending whatever of it is still running on the GPU; local to
    this rank (ncclCommDestroy finalizes, which waits for the others)."""
    _check(_library().ncclCommAbort(comm))
