"""`HostCopy`: the host copy of a `WeightStore`'s one allocation: the same bytes at the same
offsets, pinned on CUDA (pageable on a CPU, where nothing is pinned). The store decides which
byte spans to copy and when; this class owns the memory and the copies.

Rules:
- Device -> host (`refresh`): on CUDA on a side stream, after the work queued so far, by a few SM
  programs in 256 KiB chunks (engine/kernels/host_copy.py `launch_chunks`), beside generation (a
  copy engine would hold every step's small copies behind it); at once on a CPU. The kernels read
  their chunk tables from pinned memory, so every table queued since the last `wait` is kept
  until then.
- Host -> device (`restore`): one launch of a `HostCopyPlan`; the plan of the whole allocation
  (every restore after a full release) is made once, a partial one per restore.
- `drop` hands the memory back (vLLM's sleep level 2: the host RAM goes to the trainer): a refresh
  still running is waited for, the plan and tables that address the memory go with it, and on
  CUDA the caching host allocator's free blocks go back to the driver. `make` allocates it again,
  empty: the store fills it.
"""

from __future__ import annotations

import time

import torch

REFRESH_PROGRAMS = 8  # SM programs of one refresh
REFRESH_STEPS = 16  # 16 KiB steps per chunk: 256 KiB chunks


class HostCopy:
    def __init__(self, flat: torch.Tensor, nbytes: int) -> None:
        """The copy of `flat` (the store's uint8 allocation; `nbytes` of it hold weights); none
        allocated until `make`."""
        self.flat = flat
        self.nbytes = nbytes
        self.device = flat.device
        self.tensor: torch.Tensor | None = None
        self.last_refresh: dict[str, float] = {"bytes": 0, "seconds": 0.0}  # the last one waited for
        self._side: torch.cuda.Stream | None = None
        self._refreshed: torch.cuda.Event | None = None  # the last refresh queued on the side stream
        self._timing: tuple[torch.cuda.Event, int] | None = None  # (its start event, bytes)
        self._tables: list[torch.Tensor] = []  # chunk tables of refreshes queued since the last wait
        self._full_table: torch.Tensor | None = None  # a whole-allocation refresh's: made once
        self._full_plan = None  # HostCopyPlan of every byte, host -> device (CUDA): made once

    @property
    def kind(self) -> str:
        """`pinned`, `pageable` or `none` (not allocated)."""
        if self.tensor is None:
            return "none"
        return "pinned" if self.tensor.is_pinned() else "pageable"

    @property
    def nbytes_held(self) -> int:
        return 0 if self.tensor is None else self.nbytes

    def make(self) -> None:
        """Allocate the copy (uninitialised) in the allocation's layout."""
        if self.tensor is None:
            self.tensor = torch.empty(self.flat.numel(), dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def drop(self) -> float:
        """Free the copy and everything that addresses it; returns the seconds spent waiting for a
        refresh still running."""
        waited = self.wait()
        self.tensor = None
        self._full_plan = None
        self._full_table = None
        if self.device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()  # freed pinned blocks stay cached otherwise
        return waited

    def refresh(self, spans: list[tuple[int, int]]) -> None:
        """Device -> host copies of the (offset, bytes) spans; on CUDA queued on the side stream
        (the caller does not wait: `wait` does)."""
        host = self.tensor
        if host is None or not spans:
            return
        if self.device.type != "cuda":
            for o, n in spans:
                host[o : o + n].copy_(self.flat[o : o + n])
            return
        from engine.kernels.host_copy import launch_chunks

        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        rows = [(self.flat.data_ptr() + o, host.data_ptr() + o, -(-n // 16) * 16) for o, n in spans]
        with torch.cuda.stream(self._side):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._side)
            full = spans == [(0, self.nbytes)]
            table = self._full_table if full else None
            table = launch_chunks(rows, self.device, REFRESH_STEPS, programs=REFRESH_PROGRAMS, table=table)
            self._tables.append(table)
            if full:
                self._full_table = table
            self._refreshed = torch.cuda.Event(enable_timing=True)
            self._refreshed.record(self._side)
        self._timing = (start, sum(n for _, _, n in rows))

    def wait(self) -> float:
        """Block until every refresh queued has landed; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._refreshed is not None:
            self._refreshed.synchronize()
            start, nbytes = self._timing  # type: ignore[misc]
            self.last_refresh = {"bytes": nbytes, "seconds": start.elapsed_time(self._refreshed) / 1e3}
            self._refreshed = None
            self._tables.clear()
        return time.perf_counter() - t0

    def before_write(self) -> None:
        """The device waits for a refresh still reading the allocation (call before writing it)."""
        if self._refreshed is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._refreshed)

    def restore(self, spans: list[tuple[int, int]], full: bool) -> None:
        """Host -> device copies of the (offset, bytes) spans (`full`: every piece of the store),
        done when this returns."""
        host = self.tensor
        assert host is not None
        if self.device.type != "cuda":
            for o, n in spans:
                self.flat[o : o + n].copy_(host[o : o + n])
            return
        from engine.kernels.host_copy import HostCopyPlan, device_alias

        plan = self._full_plan if full else None
        if plan is None:
            alias = device_alias(host, self.device)
            plan = HostCopyPlan(alias, [o for o, _ in spans], [self.flat[o : o + n] for o, n in spans])
            if full:
                self._full_plan = plan
        plan.run()
        # A partial plan's table must outlive its kernel; the current stream alone, so as not to
        # wait for a refresh running beside it.
        torch.cuda.current_stream(self.device).synchronize()
