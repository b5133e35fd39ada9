"""`WeightUpdater`: new weights from an RL trainer, by the three routes SGLang's clients use:
from a checkpoint on disk, from tensors (CUDA IPC handles or shared memory), and broadcast over a
process group the trainer joins.

Rules:
- Every update goes through the startup loader (engine/weights/loader.py): all names, shapes and dtypes
  are validated before the first byte is copied, and each parameter is filled in place, so the
  addresses captured CUDA graphs hold stay valid. A bad update leaves the old weights in use.
- Disk updates read only below the allowed directories (default: the parent of --model); a path
  that resolves elsewhere (`..`, absolute paths, symlinks out) is refused with PermissionError.
- Every write goes through the weight store (engine/weights/store.py): it waits for a host-copy
  refresh still reading the weights, marks what was written current, and refreshes the host copy
  of those pieces in the background, so a later release/resume keeps the new weights.
- An update answers only once its copies have finished on the device: the trainer may free or
  reuse its tensors (CUDA IPC, shared memory) as soon as it has the answer.
- A process-group update receives each tensor straight into the parameter bytes it fills when
  the dtypes agree and a host copy exists (no second copy); a broadcast that fails half-way
  leaves those pieces stale, so the next forward restores the old weights from the host copy.
  Without a host copy it receives into scratch tensors and copies only once all have arrived.
  A flattened bucket (one broadcast of all the tensors' bytes) is received the same way, in one
  piece, when its tensors lie back to back in the weights in its order (the weights are laid
  out in Hugging Face's parameter order), else into one scratch tensor. vLLM's packed broadcast
  is a run of such buckets, cut where vLLM cuts them (PACKED_BUCKET_BYTES).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.parallel import TensorParallel
from engine.weights.loader import (
    checkpoint_names,
    ignored,
    load_checkpoint,
    load_named_tensors,
    validate_checkpoint,
    validate_entries,
)
from engine.weights.store import WeightStore

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


def allowed_dirs(config: EngineConfig) -> list[str]:
    """Real paths of the directories disk updates may read below."""
    if config.allowed_model_dirs:
        dirs = [d for d in config.allowed_model_dirs.split(",") if d.strip()]
    else:
        dirs = [os.path.dirname(os.path.realpath(config.model))]
    return [os.path.realpath(d.strip()) for d in dirs]


class WeightUpdater:
    def __init__(self, store: WeightStore, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.store = store
        self.tp = tp or TensorParallel()
        self._staged: list[tuple[str, torch.Tensor]] | None = None  # a payload decoded and validated
        self.model = store.model
        self.device = store.device
        self.allowed = allowed_dirs(config)
        self._groups: Any = None  # engine.weights.groups.WeightUpdateGroups, made on first use
        # Seconds of the last update's phases (receive: decode/open handles or broadcast; copy:
        # into the parameters, to the device's completion), answered with it.
        self.phases: dict[str, float] = {}
        self._last_meta: _Meta | None = None  # the last process-group update's list, validated
        self.route = ""  # how the last process-group update's bytes arrived, answered with it

    def check_path(self, model_path: str) -> str:
        """The real path of an allowed checkpoint directory, or PermissionError."""
        real = os.path.realpath(model_path)
        if not any(os.path.commonpath([real, d]) == d for d in self.allowed):
            raise PermissionError(
                f"{model_path!r} is outside the directories weight updates may read ({', '.join(self.allowed)}); "
                "start the server with --allowed-model-dirs DIR[,DIR...] naming a directory above it to allow it"
            )
        if not os.path.isdir(real):
            raise ValueError(f"model_path {model_path!r} is not a directory")
        return real

    def from_disk(self, model_path: str) -> int:
        path = self.check_path(model_path)
        self._start()
        written = load_checkpoint(self.model, path, self.store.targets)
        self._copied()
        return self._done(written)

    def validate_disk(self, model_path: str) -> None:
        """Check a checkpoint's headers against the model (nothing is read but headers)."""
        validate_checkpoint(self.model, self.check_path(model_path), self.store.targets)

    def stage_tensors(self, serialized_named_tensors: list[str], load_format: str | None) -> None:
        """Decode this rank's payload (one per rank, or one for all) and check it against the
        model; `from_staged` writes it."""
        from engine.weights.payload import decode_update

        count = len(serialized_named_tensors) if isinstance(serialized_named_tensors, list) else 0
        if count not in (1, self.tp.size):
            raise ValueError(
                f"serialized_named_tensors has {count} payloads; send one per tensor-parallel rank "
                f"({self.tp.size}) or one for all"
            )
        self._staged = None
        self._start()
        pairs = decode_update(serialized_named_tensors, load_format, self.tp.rank)
        self._phase("receive")
        entries = [(n, tuple(t.shape), t.dtype) for n, t in pairs]
        try:
            validate_entries(self.model, entries, self.store.targets)
        except BaseException:
            del pairs  # a refused push's tensors go now (CUDA IPC handles close), not with its traceback
            raise
        self._staged = pairs

    def from_staged(self) -> int:
        """Write the tensors `stage_tensors` decoded."""
        pairs, self._staged = self._staged, None
        if pairs is None:
            raise RuntimeError("no staged tensors to write")
        written = load_named_tensors(self.model, pairs, require_all=False, targets=self.store.targets)
        self._copied()
        # Close the CUDA IPC handles (or shared memory) now, before the host-copy refresh is
        # queued (after the answer): closing a handle waits for the device.
        del pairs
        self._phase("close_handles")
        return self._done(written)

    def drop_staged(self) -> None:
        """Forget a staged payload (its CUDA IPC handles close)."""
        self._staged = None

    def validate_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
        self._meta(names, dtypes, shapes)

    def _start(self) -> None:
        self.phases = {}
        self._t = time.perf_counter()
        self.store.before_write()

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._t
        self._t = now

    def _copied(self) -> None:
        """Wait for the copies into the parameters (the sources may go once the call answers)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._phase("copy")

    def _done(self, written: list[str]) -> int:
        """The store knows what was written (its host copy refreshes after the answer)."""
        self.store.written(written)
        return len(written)

    @property
    def groups(self) -> Any:
        if self._groups is None:
            from engine.weights.groups import WeightUpdateGroups

            self._groups = WeightUpdateGroups()
        return self._groups

    def after_reply(self) -> None:
        """Work the answer does not wait for: the last receive's finished works are freed."""
        if self._groups is not None:
            self._groups.drop_finished()

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
        direct = checkpoint_names(self.store.targets, (n for n, dst in zip(names, meta.into, strict=True) if dst is not None))
        buffers = [
            dst if dst is not None else torch.empty(tuple(s), dtype=d, device=self.device)
            for s, d, dst in zip(shapes, meta.dtypes, meta.into, strict=True)
        ]
        self._phase("validate")
        try:
            self.groups.receive_into(group_name, buffers)
        except BaseException:
            self.store.invalidate(direct)
            raise
        self._phase("receive")
        scratch = [(n, t) for n, t, dst in zip(names, buffers, meta.into, strict=True) if dst is None]
        written = direct + load_named_tensors(self.model, scratch, require_all=False, targets=self.store.targets)
        self._copied()
        self.route = f"per tensor, {len(direct)} of {len(names)} in place"
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
        self.groups.receive_into(group_name, [flat])
        self._phase("receive")
        pairs, offset = [], 0
        for name, shape, dtype, size in zip(names, shapes, meta.dtypes, meta.nbytes, strict=True):
            piece = flat[offset : offset + size]
            if offset % dtype.itemsize:  # back to back after an odd-sized tensor of a smaller dtype
                piece = piece.clone()
            pairs.append((name, piece.view(dtype).view(shape)))
            offset += size
        written = load_named_tensors(self.model, pairs, require_all=False, targets=self.store.targets)
        self._copied()
        self.route = "bucket via scratch"
        del pairs, flat
        if self.device.type == "cuda":  # the scratch goes back to the driver (the KV cache may resume next)
            torch.cuda.empty_cache()
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

