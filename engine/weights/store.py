"""`WeightStore`: the `weights` region as ONE device allocation. Every parameter and buffer of the
model is a view into it, the host copy has the same layout, and the store knows which pieces of
it hold the current weights.

Pieces: one per checkpoint tensor (a packed parameter's q, k and v rows are three pieces, a
packed experts tensor one per expert) and one per computed buffer (the rotary cache); callers
name pieces by checkpoint name (loader.checkpoint_names expands a packed name). A piece is current when its device bytes hold the weights
of the engine's current version; else it is stale.

Rules:
- One allocation: a release or resume of `weights` maps or unmaps one handle, not ~300, and a
  full restore is one copy. Every view starts on a 256-byte boundary; parameters come in the
  model's (Hugging Face's) order, computed buffers after them, so a trainer's flattened bucket in
  its model's order is one span (`span`), received in place. The model is built on the
  meta device and bound to the allocation once (`WeightStore(model, ...)`); parameters are never
  rebound after that (CUDA graphs hold their addresses).
- A weights release makes every piece stale (`released`); resume maps pages and copies nothing,
  so nothing a weight update will overwrite is ever restored.
- An update makes the pieces it wrote current (`written`); once its answer is sent their host
  copy is refreshed on a side stream (`refresh_host`), device to host by a few SM programs
  (engine/kernels/host_copy.py), beside generation. A release starts any refresh still pending and waits
  for it; the next write waits for a running one on the device.
- No forward and no read of the weights sees a stale piece: `ensure_current()` runs first and
  copies the stale pieces back from the host copy in one launch (buffers with no host copy are
  recomputed). With no host copy (`--weights-backup none`) a stale checkpoint tensor cannot come
  back: `missing()` counts them and the engine refuses to generate until an update writes them.
- A write that failed half-way (a broadcast cut off) makes its pieces stale again (`invalidate`):
  they come back from the host copy, i.e. the old weights.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.weights.loader import checkpoint_targets

if TYPE_CHECKING:
    from engine.kernels.host_copy import HostCopyPlan

log = logging.getLogger("siesta.engine")

ALIGN = 256  # bytes; every view starts on this boundary
# The host-copy refresh: SM programs writing device bytes into the pinned copy over PCIe, beside
# generation (a copy engine would hold every step's small copies behind it), in 256 KiB chunks.
REFRESH_PROGRAMS = 8
REFRESH_STEPS = 16


@dataclass(frozen=True)
class Piece:
    name: str  # checkpoint name, or the buffer's qualified name
    offset: int  # bytes into the allocation
    nbytes: int
    computed: bool  # a buffer the model recomputes (`init_buffers`), in no checkpoint


def _tensors(model: nn.Module) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
    """(module, attribute, is_parameter, tensor) of every parameter slot in module order, then
    every buffer slot; a tensor held by two modules (tied embeddings) appears twice. Parameters
    first and in the model's (Hugging Face's) order, so that the tensors of a checkpoint, in a
    trainer's order, lie back to back."""
    params, buffers = [], []
    for module in model.modules():
        params += [(module, name, True, p) for name, p in module._parameters.items() if p is not None]
        buffers += [(module, name, False, b) for name, b in module._buffers.items() if b is not None]
    return params + buffers


def merge_spans(pieces: Iterable[Piece]) -> list[tuple[int, int]]:
    """(offset, bytes) ranges covering the pieces, neighbours (up to ALIGN apart) merged."""
    spans: list[tuple[int, int]] = []
    for p in sorted(pieces, key=lambda p: p.offset):
        if spans and p.offset <= spans[-1][0] + spans[-1][1] + ALIGN:
            start = spans[-1][0]
            spans[-1] = (start, max(spans[-1][1], p.offset + p.nbytes - start))
        else:
            spans.append((p.offset, p.nbytes))
    return spans


class WeightStore:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        """Bind `model` (built on the meta device) to one new allocation on `device`; computed
        buffers are recomputed, parameters hold garbage until loaded."""
        self.model = model
        self.device = torch.device(device)
        offsets: dict[int, int] = {}  # id(meta tensor) -> byte offset
        end = 0
        for _, _, _, t in _tensors(model):
            if id(t) not in offsets:
                offsets[id(t)] = -(-end // ALIGN) * ALIGN
                end = offsets[id(t)] + t.numel() * t.element_size()
        self.nbytes = end
        # Rounded up to ALIGN, so that every span may be copied in whole 16-byte words.
        self.flat = torch.empty(-(-max(end, 1) // ALIGN) * ALIGN, dtype=torch.uint8, device=self.device)
        bound: dict[int, torch.Tensor] = {}
        for module, name, is_param, t in _tensors(model):
            if id(t) not in bound:
                o = offsets[id(t)]
                view = self.flat[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                bound[id(t)] = nn.Parameter(view, requires_grad=False) if is_param else view
            (module._parameters if is_param else module._buffers)[name] = bound[id(t)]
        model.init_buffers()
        self.targets = checkpoint_targets(model)  # kept: the views never move
        self.pieces = self._pieces()
        covered = sum(p.nbytes for p in self.pieces)
        held = sum(t.numel() * t.element_size() for t in bound.values())
        if covered != held:  # a tensor no piece covers would never be restored
            raise RuntimeError(f"weight pieces cover {covered} of the model's {held} bytes")
        self.index = {p.name: i for i, p in enumerate(self.pieces)}
        self.stale: set[int] = set()
        self.host: torch.Tensor | None = None
        self._host_dirty: set[int] = set()
        self._refreshed: torch.cuda.Event | None = None  # the last host refresh, on the side stream
        # The chunk tables of refreshes queued since the last wait: the kernels read them from
        # pinned memory, so none may be freed (and reused) before the side stream has passed it.
        self._refresh_tables: list[torch.Tensor] = []
        self._full_refresh_table: torch.Tensor | None = None
        self._refresh_timing: tuple[torch.cuda.Event, int] | None = None  # (start event, bytes)
        self.last_refresh: dict[str, float] = {"bytes": 0, "seconds": 0.0}  # the last one waited for
        self._side: torch.cuda.Stream | None = None
        self._full_plan: HostCopyPlan | None = None  # every piece, host -> device (CUDA)
        self.last_restore: dict[str, float] = {"bytes": 0, "seconds": 0.0}

    def _pieces(self) -> list[Piece]:
        base = self.flat.data_ptr()
        pieces = []
        for name, target in self.targets.items():
            if target.covers:  # a packed name: its pieces are the checkpoint tensors it covers
                continue
            view = target.view
            pieces.append(Piece(name, view.data_ptr() - base, view.numel() * view.element_size(), False))
        for name, buf in self.model.named_buffers():
            pieces.append(Piece(name, buf.data_ptr() - base, buf.numel() * buf.element_size(), True))
        return pieces

    # ---- the host copy ------------------------------------------------------------------------

    @property
    def host_copy_kind(self) -> str:
        """What holds the host copy: `pinned` memory (on CUDA), `pageable` memory (on a CPU, where
        nothing is pinned), or `none` (--weights-backup none)."""
        if self.host is None:
            return "none"
        return "pinned" if self.host.is_pinned() else "pageable"

    def keep_host_copy(self) -> None:
        """Allocate the host copy (pinned on CUDA) in the same layout and fill it."""
        self.host = torch.empty(self.flat.numel(), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._host_dirty = set(range(len(self.pieces)))
        self.refresh_host()
        self.wait_host()

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.nbytes

    def refresh_host(self) -> None:
        """Device -> host copies of the pieces written since the last refresh: on a side stream
        (after the work queued so far) on CUDA, so the caller does not wait; at once on a CPU. The
        engine calls it after each control call's reply; a release calls it before it waits."""
        if self.host is None or not self._host_dirty:
            return
        spans = merge_spans(self.pieces[i] for i in self._host_dirty)
        self._host_dirty.clear()
        if self.device.type != "cuda":
            for o, n in spans:
                self.host[o : o + n].copy_(self.flat[o : o + n])
            return
        from engine.kernels.host_copy import launch_chunks

        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        rows = [(self.flat.data_ptr() + o, self.host.data_ptr() + o, -(-n // 16) * 16) for o, n in spans]
        with torch.cuda.stream(self._side):
            start = torch.cuda.Event(enable_timing=True)
            start.record(self._side)
            full = len(spans) == 1 and spans[0] == (0, self.nbytes)
            table = self._full_refresh_table if full else None
            table = launch_chunks(rows, self.device, REFRESH_STEPS, programs=REFRESH_PROGRAMS, table=table)
            self._refresh_tables.append(table)
            if full:
                self._full_refresh_table = table  # a full update's: made once
            self._refreshed = torch.cuda.Event(enable_timing=True)
            self._refreshed.record(self._side)
        self._refresh_timing = (start, sum(n for _, _, n in rows))

    def wait_host(self) -> float:
        """Block until the host copy holds every written piece; returns the seconds waited."""
        t0 = time.perf_counter()
        if self._refreshed is not None:
            self._refreshed.synchronize()
            start, nbytes = self._refresh_timing
            self.last_refresh = {"bytes": nbytes, "seconds": start.elapsed_time(self._refreshed) / 1e3}
            self._refreshed = None
            self._refresh_tables.clear()
        return time.perf_counter() - t0

    # ---- what the engine tells the store ------------------------------------------------------

    def released(self) -> float:
        """The weights' pages are about to go: every piece will be stale. Call before pausing.
        Returns the seconds spent waiting for a host-copy refresh still running (an update less
        than ~0.3 s ago at 8B)."""
        self.refresh_host()  # anything written and not yet refreshed goes first
        waited = self.wait_host()
        self.stale = set(range(len(self.pieces)))
        return waited

    def before_write(self) -> None:
        """Call before writing weights: the device waits for a host refresh still reading them."""
        if self._refreshed is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._refreshed)

    def written(self, names: Iterable[str]) -> None:
        """Checkpoint tensors `names` now hold the current weights (queued on the current stream);
        their host copy is refreshed at the next `refresh_host()`."""
        done = {self.index[n] for n in names}
        self.stale -= done
        self._host_dirty |= done

    def written_all(self) -> None:
        """Every piece was rewritten in place (weights_checker's reset)."""
        self.stale.clear()
        self._host_dirty = set(range(len(self.pieces)))

    def invalidate(self, names: Iterable[str]) -> None:
        """A write to `names` may have left them half-done: they are stale again."""
        bad = {self.index[n] for n in names if n in self.index}
        self.stale |= bad
        self._host_dirty -= bad

    def span(self, views: list[torch.Tensor]) -> slice | None:
        """The byte range of the allocation that `views` fill back to back, in order, or None:
        where a trainer's flattened bucket may be received in place."""
        if not views:
            return None
        base = self.flat.data_ptr()
        start = end = views[0].data_ptr() - base
        for v in views:
            if v.data_ptr() - base != end or not v.is_contiguous():
                return None
            end += v.numel() * v.element_size()
        return slice(start, end)

    # ---- reading ------------------------------------------------------------------------------

    def missing(self) -> int:
        """How many stale checkpoint tensors cannot be restored (no host copy)."""
        if self.host is not None:
            return 0
        return sum(1 for i in self.stale if not self.pieces[i].computed)

    @property
    def stale_bytes(self) -> int:
        return sum(self.pieces[i].nbytes for i in self.stale)

    @torch.no_grad()
    def ensure_current(self) -> None:
        """Make every piece current before a forward or a read; a no-op when none is stale."""
        if not self.stale:
            return
        if self.missing():
            raise RuntimeError(f"{self.missing()} weight tensors were released without a host copy and not updated")
        t0 = time.perf_counter()
        nbytes = self.stale_bytes
        if self.host is None:  # only computed buffers are stale
            self.model.init_buffers()
        elif self.device.type == "cuda":
            self._plan().run()
            # A partial plan's table must outlive its kernel; the current stream alone, so as not
            # to wait for a host-copy refresh running beside it.
            torch.cuda.current_stream(self.device).synchronize()
        else:
            for o, n in merge_spans(self.pieces[i] for i in self.stale):
                self.flat[o : o + n].copy_(self.host[o : o + n])
        self.stale.clear()
        seconds = time.perf_counter() - t0
        self.last_restore = {"bytes": nbytes, "seconds": seconds}
        log.info("weights restored from the host copy: %.1f MiB in %.1f ms", nbytes / (1 << 20), seconds * 1e3)

    def _plan(self) -> HostCopyPlan:
        """One launch copying the stale pieces back (engine/kernels/host_copy.py); the plan of every
        piece, the common case after a resume, is made once."""
        from engine.kernels.host_copy import HostCopyPlan, device_alias

        full = len(self.stale) == len(self.pieces)
        if full and self._full_plan is not None:
            return self._full_plan
        spans = merge_spans(self.pieces[i] for i in self.stale)
        alias = device_alias(self.host, self.device)  # type: ignore[arg-type]
        plan = HostCopyPlan(alias, [o for o, _ in spans], [self.flat[o : o + n] for o, n in spans])
        if full:
            self._full_plan = plan
        return plan
