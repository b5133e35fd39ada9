"""What the CUDA driver costs under torch_memory_saver's pause and resume, call by call.

torch_memory_saver pauses with cuMemUnmap + cuMemRelease and resumes with cuMemCreate + cuMemMap +
cuMemSetAccess. This probe calls the same driver functions (ctypes on libcuda) on one large
region and times each, to answer:
- gap: does resume cost depend on how long ago the memory was released (the driver scrubbing
  freed pages in the background) rather than on the bytes?
- chunks: one handle vs many handles of the same total;
- threads: pause and resume spread over threads;
- trainer: a trainer-like cuMemAlloc/memset/cuMemFree of the same bytes between pause and resume;
- touch: the first memset after a resume against a steady one (is the cost only deferred?);
- sizes: pause and resume per GiB by handle size, with clean pages;
- first: after a wait, does the first create of any size pay, or the bytes?
- copy: pinned host -> device by a copy engine and by the SMs, idle and during the scrub.

Usage: python3 bench/probe_vmm_driver.py [--gib 100] [--sections copy,first,sizes,gap,chunks,threads,trainer]
Prints one markdown table per section; bench_memory.py imports `Driver` and `Region` for its
driver section. Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.memory.vmm import CudaDriver

GIB = 1 << 30


class Driver(CudaDriver):
    """engine.memory.vmm's driver calls plus the ones the probe times; every call is checked."""

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


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def table(title: str, *columns: str) -> None:
    print(f"\n### {title}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join(" --- " for _ in columns) + "|")


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


def section_gap(drv: Driver, total: int) -> None:
    table(
        f"gap: one {total // GIB} GiB handle; pause, sleep, resume, first touch, steady touch",
        "gap ms", "unmap ms", "release ms", "create ms", "map ms", "access ms", "first touch ms", "steady touch ms",
    )
    r = mapped(drv, total, total)
    for gap in (0.0, 0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 0.0):
        un, rel, cr, mp, ac = cycle(r, gap)
        first, steady = r.touch(), r.touch()
        cells = [f"{gap * 1e3:.0f}", *map(ms, (un, rel, cr, mp, ac, first, steady))]
        print("| " + " | ".join(cells) + " |", flush=True)
    r.pause()


def section_chunks(drv: Driver, total: int) -> None:
    table(
        f"chunks: {total // GIB} GiB as handles of a given size; gap 0 and 1 s",
        "chunk MiB", "handles", "gap s", "unmap ms", "release ms", "create ms", "map ms", "access ms",
    )
    for chunk in [c for c in (total, 8 * GIB, GIB, 64 << 20) if c <= total]:
        r = mapped(drv, total, chunk)
        for gap in (0.0, 1.0):
            un, rel, cr, mp, ac = cycle(r, gap)
            r.touch()
            print(f"| {chunk >> 20} | {r.count} | {gap:.0f} | {ms(un)} | {ms(rel)} | {ms(cr)} | {ms(mp)} | {ms(ac)} |",
                  flush=True)
        r.pause()


def section_threads(drv: Driver, total: int) -> None:
    table(
        f"threads: {total // GIB} GiB as 1 GiB handles, pause and resume over threads; gap 0 and 1 s",
        "threads", "gap s", "pause ms", "resume ms",
    )
    r = mapped(drv, total, GIB)
    for threads in (1, 4, 16):
        for gap in (0.0, 1.0):
            p = r.threaded(r.pause, threads)
            time.sleep(gap)
            q = r.threaded(r.resume, threads)
            r.touch()
            print(f"| {threads} | {gap:.0f} | {ms(p)} | {ms(q)} |", flush=True)
    r.pause()


def section_trainer(drv: Driver, total: int) -> None:
    table(
        f"trainer: pause {total // GIB} GiB, a trainer allocates/fills/frees it, sleep, resume",
        "gap ms", "pause ms", "trainer alloc ms", "trainer fill ms", "trainer free ms", "resume ms", "first touch ms",
    )
    r = mapped(drv, total, total)
    for gap in (0.0, 0.1, 0.3, 1.0, 0.0):
        p = sum(r.pause())
        t0 = time.perf_counter()
        ptr = drv.alloc(total)
        t1 = time.perf_counter()
        drv.memset(ptr, total)
        t2 = time.perf_counter()
        drv.free(ptr)
        t3 = time.perf_counter()
        time.sleep(gap)
        q = sum(r.resume())
        first = r.touch()
        print(f"| {gap * 1e3:.0f} | {ms(p)} | {ms(t1 - t0)} | {ms(t2 - t1)} | {ms(t3 - t2)} | {ms(q)} | {ms(first)} |",
              flush=True)
    r.pause()


def section_sizes(drv: Driver, total: int) -> None:
    table(
        f"sizes: {total // GIB} GiB as handles of a given size, 5 cycles each with 1 s between pause and resume "
        "(clean pages); medians",
        "chunk MiB", "handles", "unmap ms", "release ms", "create ms", "map ms", "access ms", "pause ms/GiB",
        "resume ms/GiB",
    )
    for chunk in [c for c in (total, 16 * GIB, 4 * GIB, 2 * GIB, GIB, 512 << 20) if c <= total]:
        r = mapped(drv, total, chunk)
        rows = []
        for _ in range(5):
            time.sleep(1.0)
            rows.append(cycle(r, 1.0))
            r.touch()
        med = [sorted(col)[2] for col in zip(*rows, strict=True)]
        gib = r.total / GIB
        print(f"| {chunk >> 20} | {r.count} | " + " | ".join(ms(x) for x in med)
              + f" | {(med[0] + med[1]) * 1e3 / gib:.3f} | {sum(med[2:]) * 1e3 / gib:.3f} |", flush=True)
        r.pause()


def section_first(drv: Driver, total: int) -> None:
    table(
        f"first: pause {total // GIB} GiB, wait, then a 2 MiB create before resuming the region: who pays after "
        "a wait, the first create or the bytes?",
        "wait s", "pause ms", "2 MiB create ms", "region resume ms", "region resume, no 2 MiB create first ms",
    )
    r = mapped(drv, total, total)
    small = drv.granularity
    for wait in (0.0, 0.5, 1.0, 2.0):
        p = sum(r.pause())
        time.sleep(wait)
        t0 = time.perf_counter()
        h = drv.create(small)
        tiny = time.perf_counter() - t0
        q = sum(r.resume())
        drv.release(h)
        r.touch()
        time.sleep(wait)
        r.pause()
        time.sleep(wait)
        plain = sum(r.resume())
        r.touch()
        print(f"| {wait:.1f} | {ms(p)} | {ms(tiny)} | {ms(q)} | {ms(plain)} |", flush=True)
    r.pause()


class _HostView:
    """A pinned host buffer seen as a CUDA array (UVA: the same address), so that a kernel on the
    SMs reads it over PCIe instead of a copy engine."""

    def __init__(self, t: Any) -> None:
        self.__cuda_array_interface__ = {"shape": (t.numel(),), "typestr": "<i4", "data": (t.data_ptr(), False),
                                         "version": 3}


def section_copy(drv: Driver, total: int) -> None:
    """Host -> device copy of 1 GiB from pinned memory: by a copy engine (cudaMemcpy) and by the
    SMs (an elementwise kernel reading the pinned buffer), idle and right after a pause of
    `total` bytes (while the driver scrubs them)."""
    import torch

    table(
        f"copy: 1 GiB pinned host -> device, idle and right after pausing {total // GIB} GiB (GB/s)",
        "when", "copy engine GB/s", "SM kernel (torch elementwise) GB/s", "SM kernel (engine/memory/host_copy.py) GB/s",
    )
    n = GIB // 4
    src = torch.ones(n, dtype=torch.int32, pin_memory=True)
    dst = torch.empty(n, dtype=torch.int32, device="cuda")
    try:
        view = torch.as_tensor(_HostView(src), device="cuda")
    except Exception as e:  # noqa: BLE001 - a probe: say why and measure what can be
        print(f"(no SM path: {e})")
        view = None
    r = mapped(drv, total, total)

    def timed(fn: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return GIB / (time.perf_counter() - t0) / 1e9

    def ce() -> None:
        dst.copy_(src, non_blocking=True)

    def sm() -> None:
        if view is not None:
            torch.bitwise_or(view, 0, out=dst)

    from engine.memory.host_copy import copy_from_host, device_alias

    alias = device_alias(src, dst.device)

    def engine_copy() -> None:
        copy_from_host(dst, alias)

    for _ in range(2):
        ce(), sm(), engine_copy()
    assert torch.equal(dst, torch.ones_like(dst))
    for when in ("idle", "after pause", "idle", "after pause"):
        speeds = []
        for fn in (ce, sm, engine_copy):
            time.sleep(1.5)  # the last pause's scrub is over
            r.touch()
            if when == "after pause":
                r.pause()
            speeds.append(timed(fn))
            if when == "after pause":
                r.resume()
        print(f"| {when} | " + " | ".join(f"{x:.1f}" for x in speeds) + " |", flush=True)
    r.pause()


SECTIONS = {
    "copy": section_copy, "first": section_first, "sizes": section_sizes, "gap": section_gap,
    "chunks": section_chunks, "threads": section_threads, "trainer": section_trainer,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=100)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    args = parser.parse_args()
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    drv = Driver(torch.cuda.current_device())
    print(f"device {torch.cuda.get_device_name()}, granularity {drv.granularity >> 20} MiB, "
          f"free {drv.free_bytes() / GIB:.1f} GiB, region {args.gib} GiB")
    for name in args.sections.split(","):
        SECTIONS[name](drv, args.gib * GIB)


if __name__ == "__main__":
    main()
