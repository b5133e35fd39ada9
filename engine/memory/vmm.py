"""`CudaDriver`: the CUDA driver's virtual-memory calls through ctypes on libcuda, with their
results returned instead of aborting the process.

torch_memory_saver maps a region back with cuMemCreate + cuMemMap and calls `exit(1)` when
cuMemCreate fails, so the engine must know that a resume fits before it asks. The memory regions
use this to probe a tight fit with a real allocation that fails softly (engine/memory/regions.py);
The probes of bench/history/ extended it with the calls they timed.
"""

from __future__ import annotations

import ctypes

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class CudaDriver:
    """libcuda's physical-allocation calls for one device, in the calling thread's current
    context (the engine's: torch made it current). Pinned device memory, as torch_memory_saver
    allocates it (CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE)."""

    def __init__(self, device: int) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", ctypes.byref(self.ctx))
        self.prop = AllocProp(type=1, requestedHandleTypes=0, location=Location(type=1, id=device))
        self.access = AccessDesc(location=Location(type=1, id=device), flags=3)
        gran = ctypes.c_size_t()
        self.check("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self.prop), 0)
        self.granularity = gran.value

    def call(self, name: str, *args: object) -> int:
        """The CUresult of one driver call."""
        return int(getattr(self.lib, name)(*args))

    def check(self, name: str, *args: object) -> None:
        rc = self.call(name, *args)
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def try_create(self, size: int) -> int | None:
        """A physical allocation of `size` bytes (rounded up to the granularity); None when the
        device is out of memory. Other failures raise."""
        size = -(-size // self.granularity) * self.granularity
        handle = ctypes.c_uint64()
        rc = self.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self.prop),
                       ctypes.c_ulonglong(0))
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            return None
        if rc != CUDA_SUCCESS:
            raise RuntimeError(f"cuMemCreate failed with CUresult {rc}")
        return handle.value

    def create(self, size: int) -> int:
        handle = self.try_create(size)
        if handle is None:
            raise RuntimeError(f"cuMemCreate of {size} bytes: out of memory")
        return handle

    def release(self, handle: int) -> None:
        self.check("cuMemRelease", ctypes.c_uint64(handle))

    def can_allocate(self, size: int) -> bool:
        """Whether `size` bytes can be created now: created, then released at once."""
        handle = self.try_create(size)
        if handle is None:
            return False
        self.release(handle)
        return True

    def free_bytes(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value
