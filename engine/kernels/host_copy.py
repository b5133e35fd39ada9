"""Host -> device copies run by the SMs, reading pinned host memory over PCIe (zero-copy).

Why not `cudaMemcpy`: a copy engine moves pinned memory at the PCIe peak (~55 GB/s on an H200)
only while nothing else uses the copy engines, and right after any large free the driver scrubs
the freed pages with them. A weights restore right after a release, or right after a trainer's
`empty_cache()`, then runs at half speed (27 GB/s measured; bench/history, the VMM driver probe's section
copy). A kernel on the SMs that reads the pinned buffer runs at ~51 GB/s either way.

Rules:
- The source is pinned host memory (page-locked and, under UVA, mapped into the device's address
  space at the same address); `device_alias` shows it to kernels as a CUDA uint8 tensor.
- Source and destination are contiguous byte ranges of equal length; ranges whose addresses and
  lengths are multiples of 16 move 16 bytes per load (Triton specializes on that).
- Copies run on the current stream, like `Tensor.copy_`.
- `HostCopyPlan` moves many tensors in one launch (a launch per tensor leaves the link idle
  between small kernels): its table of chunks lives in pinned host memory too, so it needs no
  device memory that a release could take away.
- `copy_tensors` runs a weight update's small device-to-device copies in one launch by the same
  kernel (a table of (source, destination, bytes) chunks, read from pinned memory); large ones
  are cudaMemcpy's, which is faster per byte.
- `launch_chunks` with few programs writes device memory into pinned host memory by the SMs: the
  weights' host-copy refresh runs beside generation that way, where a 16 GB cudaMemcpy would hold
  the copy engine and every step's small token copy would queue behind it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 16384  # bytes per program step: 128 threads x 8 loads of 16 B in flight each
_PLAN_STEPS = 16  # steps per program of a plan: chunks of 256 KiB


class _CudaArray:
    """`__cuda_array_interface__` of a pinned host buffer, as bytes at its own (UVA) address."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": (host.numel() * host.element_size(),),
            "typestr": "|u1",
            "data": (host.data_ptr(), False),
            "version": 3,
        }


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA uint8 tensor at the address of the pinned, contiguous host tensor `host` (no copy).
    Kernels that read it read host memory over PCIe; it lives as long as `host` does."""
    if not (host.is_pinned() and host.is_contiguous()):
        raise ValueError("device_alias needs a pinned, contiguous host tensor")
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(host), device=device)


@triton.jit
def _copy_bytes(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src, byte for byte, by the SMs. dst: a contiguous CUDA tensor; src: a uint8 slice
    of a `device_alias` with dst's byte length."""
    dst_bytes = dst.view(-1).view(torch.uint8)
    n = dst_bytes.numel()
    if src.dtype != torch.uint8 or src.numel() != n:
        raise ValueError(f"copy_from_host: {src.numel()} source bytes ({src.dtype}) for {n} destination bytes")
    if n:
        _copy_bytes[(triton.cdiv(n, _BLOCK),)](src, dst_bytes, n, BLOCK=_BLOCK, num_warps=4)


@triton.jit
def _copy_chunks(table, num_chunks, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # table: int64 [num_chunks, 3] = (source address, destination address, bytes), every one a
    # multiple of 16; program p copies chunks p, p + P, p + 2P, ... (P programs), each of at most
    # BLOCK * STEPS bytes. Addresses may be pinned host memory (UVA) on either side.
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        row = table + c.to(tl.int64) * 3
        # The hints go on the pointers: an alignment known only for the integer is lost in the
        # cast, and the loads fall back to single bytes (half the PCIe bandwidth, measured).
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.uint8)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.uint8)), 16)
        n = tl.multiple_of(tl.load(row + 2), 16)
        for i in range(STEPS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _chunk_table(spans: torch.Tensor, chunk: int) -> torch.Tensor:
    """spans int64 [k, 3] = (source, destination, bytes) -> chunks int64 [c, 3] of at most
    `chunk` bytes each, in order (vectorized: a 16 GB model is ~16k rows)."""
    counts = (spans[:, 2] + chunk - 1) // chunk
    which = torch.repeat_interleave(torch.arange(len(spans)), counts)
    first = torch.cumsum(counts, 0) - counts
    offs = (torch.arange(int(counts.sum())) - first[which]) * chunk
    picked = spans[which]
    return torch.stack([picked[:, 0] + offs, picked[:, 1] + offs, torch.clamp(picked[:, 2] - offs, max=chunk)], 1)


def launch_chunks(
    spans: list[tuple[int, int, int]], device: torch.device, steps: int, programs: int | None = None,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy (source address, destination address, bytes) spans, all multiples of 16, in one launch
    on the current stream: one program per chunk of BLOCK * steps bytes, or `programs` programs
    looping over them (fewer SMs held, for a copy that runs beside the model). Returns the
    pinned chunk table, which must live until the launch has run (and may be passed back as
    `table` to launch the same spans again without building it)."""
    if table is None:
        table = _chunk_table(torch.tensor(spans, dtype=torch.int64).reshape(-1, 3), _BLOCK * steps).contiguous().pin_memory()
    if len(table):
        alias = device_alias(table, device).view(torch.int64)
        grid = len(table) if programs is None else min(programs, len(table))
        _copy_chunks[(grid,)](alias, len(table), BLOCK=_BLOCK, STEPS=steps, num_warps=4)
    return table


_DEVICE_STEPS = 64  # device-to-device chunks of 1 MiB
# A tensor this large is copied alone (`Tensor.copy_`: cudaMemcpy runs at ~1.9 TB/s on an H200,
# the chunk kernel at ~1.1-1.4); smaller ones share one launch.
COPY_ALONE_BYTES = 1 << 20


def copy_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> tuple[list[int], torch.Tensor | None]:
    """dsts[i][:] = srcs[i], byte for byte, in one launch on the current stream, for every pair
    below COPY_ALONE_BYTES that is contiguous, of one dtype and shape, on dsts' device, with
    16-byte aligned addresses and lengths. Returns (indices of the other pairs, left for the
    caller's `Tensor.copy_`; the pinned chunk table, which the caller keeps until the stream has
    passed the launch)."""
    device = dsts[0].device if dsts else torch.device("cpu")
    rows, rest = [], []
    for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
        n = d.numel() * d.element_size()
        ok = (n < COPY_ALONE_BYTES and d.dtype == s.dtype and d.shape == s.shape and d.is_contiguous()
              and s.is_contiguous() and d.device == s.device == device and not (d.data_ptr() | s.data_ptr() | n) % 16)
        if ok and n:
            rows.append((s.data_ptr(), d.data_ptr(), n))
        elif not ok:
            rest.append(i)
    if not rows:
        return rest, None
    return rest, launch_chunks(rows, device, _DEVICE_STEPS)


class HostCopyPlan:
    """Copies of fixed (source bytes of one `device_alias`, destination tensor) pairs, made once
    and run after every resume. Pairs whose addresses and lengths are multiples of 16 go in one
    launch over chunks of 256 KiB; the rest (rare: odd lengths) get a launch each."""

    def __init__(self, base: torch.Tensor, offsets: list[int], dsts: list[torch.Tensor]) -> None:
        self.base = base
        rows: list[tuple[int, int, int]] = []
        self.odd: list[tuple[torch.Tensor, torch.Tensor]] = []
        for offset, dst in zip(offsets, dsts, strict=True):
            n = dst.numel() * dst.element_size()
            if (offset | dst.data_ptr() | n | base.data_ptr()) % 16:
                self.odd.append((dst, base[offset : offset + n]))
            elif n:
                rows.append((base.data_ptr() + offset, dst.data_ptr(), n))
        spans = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
        self.table = _chunk_table(spans, _BLOCK * _PLAN_STEPS).contiguous().pin_memory()
        self.chunks = len(self.table)
        self.table_on_device = device_alias(self.table, base.device).view(torch.int64)

    def run(self) -> None:
        """Every copy of the plan, on the current stream (destinations must still be where they
        were: the weights region keeps its addresses across release and resume)."""
        if self.chunks:
            _copy_chunks[(self.chunks,)](self.table_on_device, self.chunks, BLOCK=_BLOCK, STEPS=_PLAN_STEPS, num_warps=4)
        for dst, src in self.odd:
            copy_from_host(dst, src)
