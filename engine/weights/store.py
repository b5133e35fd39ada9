"""`WeightStore`: the `weights` region as ONE device allocation. Every parameter and buffer of the
model is a view into it, the host copy has the same layout, and the store knows which pieces of
it hold the current weights.

Pieces: one per checkpoint tensor (a packed parameter's q, k and v rows are three pieces, a
packed experts tensor one per expert) and one per computed buffer (the rotary cache); callers
name pieces by checkpoint name (targets.checkpoint_names expands a packed name). A piece is
current when its device bytes hold the weights of the engine's current version; else it is stale.

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
  copy is refreshed beside generation (`refresh_host`; engine/weights/host_copy.py does the
  copies). A release starts any refresh still pending and waits for it; the next write waits for
  a running one on the device.
- No forward and no read of the weights sees a stale piece: `ensure_current()` runs first and
  copies the stale pieces back from the host copy in one launch (buffers with no host copy are
  recomputed). With no host copy a stale checkpoint tensor cannot come back: `missing()` counts
  them and the engine refuses to generate until an update writes them.
- The host copy is kept (`keep_host_copy`, --weights-backup host) or not (none). A kept copy is
  dropped by a level-2 release (`drop_host`: its host RAM goes back) and made again, whole, by
  the first `refresh_host` after every checkpoint tensor is current again (after the reply of the
  update that wrote the last of them, whatever the route); a partial update leaves it dropped.
- A write that failed half-way (a broadcast cut off) makes its pieces stale again (`invalidate`):
  they come back from the host copy, i.e. the old weights.
- Pieces named with targets.OPTIONAL_PREFIX (a draft model's) never stop generation: stale with
  no host copy to restore them, they are `lost` until an update writes them, and their model is
  not run meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.weights.host_copy import HostCopy
from engine.weights.targets import OPTIONAL_PREFIX, checkpoint_targets

log = logging.getLogger("siesta.engine")

ALIGN = 256  # bytes; every view starts on this boundary


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
        self.lost: set[int] = set()  # optional pieces stale with no host copy (module docstring)
        self.backup = HostCopy(self.flat, self.nbytes)
        self.keeps_host = False  # --weights-backup host: `keep_host_copy` was called
        self._host_dirty: set[int] = set()  # pieces written since the host copy's last refresh
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
    def host(self) -> torch.Tensor | None:
        """The host copy's bytes (the allocation's layout), or None."""
        return self.backup.tensor

    @property
    def host_copy_kind(self) -> str:
        """What holds the host copy: `pinned` memory (on CUDA), `pageable` memory (on a CPU, where
        nothing is pinned), `discarded` (dropped by a level-2 release, made again once an update
        has written every checkpoint tensor) or `none` (--weights-backup none)."""
        if self.keeps_host and self.host is None:
            return "discarded"
        return self.backup.kind

    @property
    def host_bytes(self) -> int:
        return self.backup.nbytes_held

    @property
    def last_refresh(self) -> dict[str, float]:
        return self.backup.last_refresh

    def keep_host_copy(self) -> None:
        """Keep a host copy from now on (--weights-backup host): allocate it and fill it."""
        self.keeps_host = True
        self._fill_host()
        self.wait_host()

    def drop_host(self) -> float:
        """Free the host copy (a level-2 release: the host RAM goes back to the trainer). Until an
        update has written every checkpoint tensor a stale one cannot come back (`missing`);
        then `refresh_host` makes the copy again. Returns the seconds spent waiting for a refresh
        still running."""
        self._host_dirty.clear()
        return self.backup.drop()

    def _fill_host(self) -> None:
        """Allocate the host copy and queue the copy of every piece into it."""
        self.backup.make()
        self._host_dirty = set(range(len(self.pieces)))
        self.refresh_host()

    def refresh_host(self) -> None:
        """Device -> host copies of the pieces written since the last refresh: on a side stream on
        CUDA, so the caller does not wait; at once on a CPU. The engine calls it after each control
        call's reply; a release calls it before it waits. The one rule that makes a dropped copy
        again lives here: once no checkpoint tensor is stale (an update wrote them all), the copy
        is allocated and filled whole; never earlier, so it never holds a byte of garbage."""
        if self.host is None and self.keeps_host and not self.missing():
            self.ensure_current()  # only computed buffers can be stale: recomputed
            try:
                self._fill_host()
            except RuntimeError as e:  # out of host memory: the weights stay valid on the device
                log.warning("host copy of the weights not made again (%s): until it is, a release loses them", e)
                return
            log.info("host copy of the weights made again (%s, %.1f MiB)", self.host_copy_kind, self.nbytes / (1 << 20))
            return
        if self.host is None or not self._host_dirty:
            return
        spans = merge_spans(self.pieces[i] for i in self._host_dirty)
        self._host_dirty.clear()
        self.backup.refresh(spans)

    def wait_host(self) -> float:
        """Block until the host copy holds every written piece; returns the seconds waited."""
        return self.backup.wait()

    # ---- what the engine tells the store ------------------------------------------------------

    def released(self, drop_host: bool = False) -> float:
        """The weights' pages are about to go: every piece will be stale. Call before pausing.
        With `drop_host` (a level-2 release) the host copy goes too, unrefreshed. Returns the
        seconds spent waiting for a host-copy refresh still running (an update less than ~0.3 s
        ago at 8B)."""
        if drop_host:
            waited = self.drop_host()
        else:
            self.refresh_host()  # anything written and not yet refreshed goes first
            waited = self.wait_host()
        self.stale = set(range(len(self.pieces)))
        return waited

    def before_write(self) -> None:
        """Call before writing weights: the device waits for a host refresh still reading them."""
        self.backup.before_write()

    def written(self, names: Iterable[str]) -> None:
        """Checkpoint tensors `names` now hold the current weights (queued on the current stream);
        their host copy is refreshed at the next `refresh_host()`."""
        done = {self.index[n] for n in names}
        self.stale -= done
        self.lost -= done
        self._host_dirty |= done

    def written_all(self) -> None:
        """Every piece was rewritten in place (weights_checker's reset)."""
        self.stale.clear()
        self.lost.clear()
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
        return sum(1 for i in self.stale if not self.pieces[i].computed and not self._optional(i))

    def _optional(self, i: int) -> bool:
        return self.pieces[i].name.startswith(OPTIONAL_PREFIX)

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
        if self.host is None:  # only computed buffers are stale, and optional pieces, now lost
            self.lost |= {i for i in self.stale if not self.pieces[i].computed}
            self.model.init_buffers()
        else:
            spans = merge_spans(self.pieces[i] for i in self.stale)
            self.backup.restore(spans, full=len(self.stale) == len(self.pieces))
        self.stale.clear()
        seconds = time.perf_counter() - t0
        self.last_restore = {"bytes": nbytes, "seconds": seconds}
        log.info("weights restored from the host copy: %.1f MiB in %.1f ms", nbytes / (1 << 20), seconds * 1e3)
