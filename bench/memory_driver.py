"""The CUDA driver's own cost under a release and a resume, for bench_memory.py's driver section:
torch_memory_saver pauses with cuMemUnmap + cuMemRelease and resumes with cuMemCreate + cuMemMap +
cuMemSetAccess; `Region` makes the same calls (ctypes on libcuda, through engine.memory.vmm) on
one virtual range backed by handles of a given size, and `cycle` times each of them."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

from engine.memory.vmm import CudaDriver


class Driver(CudaDriver):
    """engine.memory.vmm's driver calls plus the ones timed here; every call is checked."""

    def bind_thread(self) -> None:
        self.check("cuCtxSetCurrent", self.ctx)

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.check("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return ptr.value

    def map(self, ptr: int, size: int, handle: int) -> None:
        self.check("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(handle), ctypes.c_ulonglong(0))

    def set_access(self, ptr: int, size: int) -> None:
        self.check("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self.access),
                   ctypes.c_size_t(1))

    def unmap(self, ptr: int, size: int) -> None:
        self.check("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def memset(self, ptr: int, size: int) -> None:
        self.check("cuMemsetD32_v2", ctypes.c_uint64(ptr), ctypes.c_uint(0x01010101), ctypes.c_size_t(size // 4))
        self.check("cuCtxSynchronize")

    def alloc(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self.check("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check("cuMemFree_v2", ctypes.c_uint64(ptr))


class Region:
    """`total` bytes at one virtual range, backed by handles of `chunk` bytes each."""

    def __init__(self, drv: Driver, total: int, chunk: int) -> None:
        self.drv, self.chunk = drv, chunk
        self.count = total // chunk
        self.total = self.count * chunk
        self.base = drv.reserve(self.total)
        self.handles: list[int] = []

    def pause(self, lo: int = 0, hi: int | None = None) -> tuple[float, float]:
        """Unmap then release parts [lo, hi); (unmap s, release s)."""
        hi = self.count if hi is None else hi
        t0 = time.perf_counter()
        for i in range(lo, hi):
            self.drv.unmap(self.base + i * self.chunk, self.chunk)
        t1 = time.perf_counter()
        for i in range(lo, hi):
            self.drv.release(self.handles[i])
        return t1 - t0, time.perf_counter() - t1

    def resume(self, lo: int = 0, hi: int | None = None) -> tuple[float, float, float]:
        """Create, map, set access for parts [lo, hi); (create s, map s, access s)."""
        hi = self.count if hi is None else hi
        if not self.handles:
            self.handles = [0] * self.count
        t0 = time.perf_counter()
        for i in range(lo, hi):
            self.handles[i] = self.drv.create(self.chunk)
        t1 = time.perf_counter()
        for i in range(lo, hi):
            self.drv.map(self.base + i * self.chunk, self.chunk, self.handles[i])
        t2 = time.perf_counter()
        self.drv.set_access(self.base + lo * self.chunk, (hi - lo) * self.chunk)
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def threaded(self, fn: Callable[[int, int], object], threads: int) -> float:
        step = -(-self.count // threads)
        def work(lo: int) -> None:
            self.drv.bind_thread()
            fn(lo, min(lo + step, self.count))
        ts = [threading.Thread(target=work, args=(lo,)) for lo in range(0, self.count, step)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    def touch(self) -> float:
        t0 = time.perf_counter()
        self.drv.memset(self.base, self.total)
        return time.perf_counter() - t0


def cycle(r: Region, gap: float) -> tuple[float, ...]:
    """Pause, wait `gap`, resume: (unmap, release, create, map, access) seconds."""
    unmap, release = r.pause()
    time.sleep(gap)
    return (unmap, release, *r.resume())


def mapped(drv: Driver, total: int, chunk: int) -> Region:
    """A region backed and touched once (its pages really exist before the first pause)."""
    r = Region(drv, total, chunk)
    r.resume()
    r.touch()
    return r
