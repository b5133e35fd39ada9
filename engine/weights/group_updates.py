"""`GroupUpdates`: the weight updater's process-group route (SGLang's
`update_weights_from_distributed`, vLLM's NCCL weight transfer): the trainer, rank 0 of a group
this engine's ranks join, broadcasts the new tensors.

Rules:
- (names, dtypes, shapes) are validated against the model before the first broadcast is joined;
  a trainer sends the same list every step, so the last list validated is kept.
- Per tensor, with a host copy: each tensor is received straight into the parameter bytes it
  fills when the dtypes agree (no second copy), and the rest (a tensor-parallel rank's slice,
  another dtype) into two scratch slots reused in turn, copied out while the next broadcast runs.
  A broadcast that fails half-way leaves what it wrote stale, so the next forward restores the
  old weights from the host copy. Without a host copy (a CPU, --weights-backup none) everything
  arrives in scratch before the first copy: all or nothing.
- A flattened bucket (SGLang's: one broadcast of all the tensors' bytes back to back) is received
  in place when its tensors lie back to back in the weights in its order (the weights are laid
  out in Hugging Face's parameter order), else into one scratch tensor whose copies out (a TP
  rank's slices) are queued while the broadcast runs. vLLM's packed broadcast is a run of such
  buckets, cut where vLLM cuts them (PACKED_BUCKET_BYTES).
- Scratch is freed after the answer (`after_reply`), before the next call (a KV resume) runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from engine.weights.loader import load_named_tensors, validate_entries
from engine.weights.targets import checkpoint_names, ignored

# vLLM's packed weight broadcast: a bucket closes once its bytes pass this (its
# DEFAULT_PACKED_BUFFER_SIZE_BYTES; sender and receiver must agree).
PACKED_BUCKET_BYTES = 1 << 30


@dataclass(frozen=True)
class _Meta:
    """A validated (names, dtypes, shapes) list of a process-group update."""

    key: tuple[Any, ...]  # the list as sent (and whether a host copy exists)
    dtypes: tuple[torch.dtype, ...]
    into: tuple[torch.Tensor | None, ...]  # per tensor: the parameter bytes it is received into, or None
    nbytes: tuple[int, ...]
    span: slice | None  # the weights' bytes the tensors fill back to back, in order (or None)


class GroupUpdates:
    """Mixed into `WeightUpdater` (engine/weights/updater.py), whose state it uses: `model`,
    `store`, `device`, `tp`, `route`, `_groups`, `_last_meta`, and its phase clock (`_start`,
    `_phase`, `_copied`, `_done`)."""

    def validate_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        self._meta(names, dtypes, shapes)

    @property
    def groups(self) -> Any:
        if self._groups is None:
            from engine.weights.groups import WeightUpdateGroups

            self._groups = WeightUpdateGroups()
        return self._groups

    def after_reply(self) -> None:
        """Work the answer does not wait for: the last receive's finished works and its scratch
        are freed, the scratch back to the driver (the KV cache may resume next)."""
        if self._groups is not None:
            self._groups.drop_finished()
        if self._leftover:
            self._leftover = []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def init_group(self, rank_offset: int, **kwargs: Any) -> None:
        """Join the trainer's group as rank `rank_offset` + this tensor-parallel rank (SGLang's)."""
        self.groups.init(device=self.device, rank_offset=rank_offset + self.tp.rank, **kwargs)

    def from_distributed(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
        load_format: str | None = None,
    ) -> int:
        """Validate (names, dtypes, shapes), then join the trainer's broadcasts: one per tensor
        (straight into the parameters where the dtype is theirs, into scratch tensors elsewhere),
        or one flat byte tensor for load_format "flattened_bucket" (SGLang's: the tensors' bytes
        back to back, in order): straight into the weights when they lie back to back there in
        the same order (a trainer sending its model's parameters in order), else into scratch,
        then copied in one batch."""
        self._start()
        if load_format == "packed":
            return self._from_packed(group_name, names, dtypes, shapes)
        meta = self._meta(names, dtypes, shapes)
        if load_format == "flattened_bucket":
            return self._from_bucket(group_name, names, shapes, meta)
        if self.store.host is not None:
            return self._per_tensor(group_name, names, shapes, meta)
        # No host copy: all or nothing, so everything arrives into scratch before the first copy.
        buffers = [torch.empty(tuple(s), dtype=d, device=self.device) for s, d in zip(shapes, meta.dtypes, strict=True)]
        self._phase("validate")
        self.groups.receive_into(group_name, buffers)
        self._phase("receive")
        written = load_named_tensors(self.model, list(zip(names, buffers, strict=True)), require_all=False,
                                     targets=self.store.targets)
        self._copied()
        self._leftover = buffers  # the model's size: back to the driver after the answer, before a KV resume
        self.route = f"per tensor, 0 of {len(names)} in place"
        return self._done(written)

    def _per_tensor(self, group_name: str, names: list[str], shapes: list[list[int]], meta: _Meta) -> int:
        """With a host copy: each tensor lands in its parameter's bytes, or (a tensor-parallel
        rank's slice, another dtype) in one of two scratch slots of the largest such tensor's
        size, copied out while the next broadcast runs. Scratch is two tensors, not the model's
        size: a rank of TP=2 keeps half of what arrives. A broadcast cut off half-way leaves what
        it wrote stale, and the host copy restores it."""
        sizes = [n for n, dst in zip(meta.nbytes, meta.into, strict=True) if dst is None]
        slots = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(min(2, len(sizes)))]
        buffers: list[torch.Tensor] = []
        landed: dict[int, Any] = {}
        through = 0
        for i, (name, shape, dtype, dst) in enumerate(zip(names, shapes, meta.dtypes, meta.into, strict=True)):
            if dst is not None:
                buffers.append(dst)
                continue
            buf = slots[through % len(slots)][: meta.nbytes[i]].view(dtype).view(tuple(shape))
            through += 1
            buffers.append(buf)
            if not ignored(self.model, name):
                copies = self.store.targets[name].copies(buf)
                landed[i] = lambda copies=copies: [dst.copy_(src) for dst, src in copies]
        written = checkpoint_names(self.store.targets, (n for n in names if not ignored(self.model, n)))
        self._phase("validate")
        try:
            self.groups.receive_into(group_name, buffers, landed)
        except BaseException:
            self.store.invalidate(written)
            raise
        self._phase("receive")
        self._copied()
        del buffers, landed
        self._leftover = slots  # freed after the answer (`after_reply`), before the next call
        self.route = f"per tensor, {len(names) - through} of {len(names)} in place" + (
            f", {through} through two scratch slots" if through else "")
        return self._done(written)

    def _from_packed(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        """vLLM's packed broadcast (its packed_tensor.py): the tensors in order, cut into buckets,
        each closed by the first tensor that takes it past PACKED_BUCKET_BYTES; each bucket one
        flattened broadcast. Every bucket is validated before the first is received."""
        meta = self._meta(names, dtypes, shapes)  # the whole list, so nothing is received when any is bad
        cuts, total = [0], 0
        for i, size in enumerate(meta.nbytes):
            total += size
            if total > PACKED_BUCKET_BYTES:
                cuts.append(i + 1)
                total = 0
        if cuts[-1] != len(names):
            cuts.append(len(names))
        buckets = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
        written = done = 0  # names[:done] are written
        try:
            for a, b in buckets:
                part = self._meta(names[a:b], dtypes[a:b], shapes[a:b])
                written += self._from_bucket(group_name, names[a:b], shapes[a:b], part)
                done = b
        except BaseException:  # all or nothing: the buckets written go back to the old weights
            self.store.invalidate(checkpoint_names(self.store.targets, names[:done]))
            raise
        self.route = f"packed, {len(buckets)} bucket(s)"
        return written

    def _from_bucket(self, group_name: str, names: list[str], shapes: list[list[int]], meta: _Meta) -> int:
        self._phase("validate")
        if meta.span is not None:  # the bucket's layout is the weights' own: received in place
            written = checkpoint_names(self.store.targets, names)
            try:
                self.groups.receive_into(group_name, [self.store.flat[meta.span]])
            except BaseException:
                self.store.invalidate(written)
                raise
            self._phase("receive")
            self._copied()
            self.route = "bucket in place"
            return self._done(written)
        flat = torch.empty(sum(meta.nbytes), dtype=torch.uint8, device=self.device)
        offsets = [0, *itertools.accumulate(meta.nbytes)][:-1]  # each tensor's start in the bucket
        if self.store.host is not None and all(o % d.itemsize == 0 for o, d in zip(offsets, meta.dtypes, strict=True)):
            # The copies out of the scratch are queued while the broadcast runs (the current
            # stream waits for it); cut off half-way, they wrote garbage: the pieces go stale.
            views = [(n, flat[o : o + b].view(d).view(tuple(s)))
                     for n, s, d, o, b in zip(names, shapes, meta.dtypes, offsets, meta.nbytes, strict=True)]
            kept = [(n, t) for n, t in views if not ignored(self.model, n)]
            copies = [c for n, t in kept for c in self.store.targets[n].copies(t)]
            written = checkpoint_names(self.store.targets, (n for n, _ in kept))
            try:
                self.groups.receive_into(group_name, [flat], {0: lambda: [dst.copy_(src) for dst, src in copies]})
            except BaseException:
                self.store.invalidate(written)
                raise
            self._phase("receive")
            del views, kept, copies
        else:  # no host copy to undo a cut-off broadcast: all of it arrives before the first copy
            self.groups.receive_into(group_name, [flat])
            self._phase("receive")
            pairs = []
            for name, shape, dtype, offset, size in zip(names, shapes, meta.dtypes, offsets, meta.nbytes, strict=True):
                piece = flat[offset : offset + size]
                if offset % dtype.itemsize:  # back to back after an odd-sized tensor of a smaller dtype
                    piece = piece.clone()
                pairs.append((name, piece.view(dtype).view(shape)))
            written = load_named_tensors(self.model, pairs, require_all=False, targets=self.store.targets)
            del pairs
        self._copied()
        self.route = "bucket via scratch"
        self._leftover = [flat]  # freed after the answer (`after_reply`), before the next call
        return self._done(written)

    def _meta(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> _Meta:
        """Validate (names, dtypes, shapes) against the model. A trainer sends the same list every
        step: the last one validated is kept, keyed by the list (parameters never move, so its
        receive buffers stay true)."""
        from engine.weights.groups import check_meta

        shape_key = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in shapes)
        key = (tuple(names), tuple(map(str, dtypes)), shape_key, self.store.host is None)
        if self._last_meta is not None and self._last_meta.key == key:
            return self._last_meta
        parsed = check_meta(names, dtypes, shapes)
        targets = validate_entries(self.model, zip(names, map(tuple, shapes), parsed, strict=True), self.store.targets)
        # Straight into the parameters only where the host copy can undo a broadcast cut off
        # half-way; without one (a CPU, --weights-backup none) scratch tensors keep it all or nothing.
        into = tuple(
            None if self.store.host is None or ignored(self.model, n) or targets[n].view.dtype != d
            or not targets[n].whole  # a tensor-parallel rank keeps a slice of what arrives
            else targets[n].view
            for n, d in zip(names, parsed, strict=True)
        )
        nbytes = tuple(torch.Size(s).numel() * d.itemsize for s, d in zip(shapes, parsed, strict=True))
        span = self.store.span(list(into)) if into and all(v is not None for v in into) else None
        self._last_meta = _Meta(key, tuple(parsed), into, nbytes, span)
        return self._last_meta

    def destroy_group(self, group_name: str) -> None:
        self.groups.destroy(group_name)
