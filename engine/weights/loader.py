"""Loading weights into a built model, from a safetensors checkpoint or from named tensors (RL
weight updates), always in place.

Rules:
- Tensors are copied into the existing parameters (`param.data[rows].copy_(t)`, cast to the
  parameter's dtype and device); a parameter is never rebound, since CUDA graphs hold its address.
- Two phases, so that a load is all or nothing: every (name, shape, dtype) is checked against the
  model first, from safetensors headers alone for a checkpoint; only then is anything copied.
- Names are the checkpoint's (Hugging Face) names; where each lands (packed parameters, packed
  experts, a family's aliases) is targets.py's. Ignored: rotary `inv_freq` buffers, and
  `lm_head.weight` when the model ties its embeddings.
- Work per tensor is a few dictionary look-ups and one copy: a Qwen3-30B-A3B update names ~18,900
  tensors, and its validation and copy time must scale with bytes, not names.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from engine.weights.targets import OPTIONAL_PREFIX, Target, checkpoint_targets, ignored

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_FLOAT_NAMES = frozenset(_FLOAT_DTYPES.values())


class WeightLoadError(ValueError):
    """A checkpoint or update that does not fit the model; the message names the tensor or file."""


# ---- validation and copy -------------------------------------------------------------------


def _validate(
    model: nn.Module,
    targets: dict[str, Target],
    entries: Iterable[tuple[str, tuple[int, ...], str]],  # (name, shape, safetensors dtype)
    require_all: bool,
) -> None:
    seen: set[str] = set()
    for name, shape, dtype in entries:
        if ignored(model, name):
            continue
        target = targets.get(name)
        if target is None:
            raise WeightLoadError(f"unexpected tensor {name!r}: the model has no such weight")
        if tuple(shape) != target.shape:
            raise WeightLoadError(
                f"tensor {name!r} has shape {list(shape)}, the model expects {list(target.shape)}"
            )
        if dtype not in _FLOAT_NAMES:
            raise WeightLoadError(
                f"tensor {name!r} has dtype {dtype}; supported: {', '.join(_FLOAT_DTYPES.values())}"
            )
        if target.covers:
            seen.update(target.covers)
        else:
            seen.add(name)
    if require_all:
        needed = [name for name, target in targets.items() if not target.covers and not name.startswith(OPTIONAL_PREFIX)]
        missing = [name for name in needed if name not in seen]
        if missing:
            raise WeightLoadError(
                f"missing tensor {missing[0]!r} ({len(missing)} of {len(needed)} missing)"
            )


@torch.no_grad()
def _copy(model: nn.Module, targets: dict[str, Target], pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Copy each pair into its target; the names copied, in order. Host tensors are copied as
    they come (a checkpoint streams file by file); tensors already on the GPU (CUDA IPC, a
    broadcast) are copied by cudaMemcpy when large and together in one launch when small
    (engine/kernels/host_copy.py)."""
    written: list[str] = []
    on_device: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, tensor in pairs:
        if ignored(model, name):
            continue
        target = targets[name]
        for dst, src in target.copies(tensor):
            if dst.is_cuda and src.is_cuda:
                on_device.append((dst, src))
            else:
                dst.copy_(src)
        written.extend(target.covers or (name,))
    if on_device:
        from engine.kernels.host_copy import copy_tensors

        dsts, srcs = [d for d, _ in on_device], [s for _, s in on_device]
        rest, table = copy_tensors(dsts, srcs)
        for i in rest:
            dsts[i].copy_(srcs[i])
        if table is not None:  # the launch reads its chunk table from pinned memory: keep it till then
            torch.cuda.current_stream(dsts[0].device).synchronize()
    return written


# ---- the checkpoint side -------------------------------------------------------------------


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory: those its index names, else
    `model.safetensors`, else every `*.safetensors` in it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        names = [SINGLE_FILE]
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not names:
            raise WeightLoadError(f"no safetensors weights in {path!r}")
    files = [os.path.join(path, n) for n in names]
    for file in files:
        if not os.path.isfile(file):
            raise WeightLoadError(f"weight file {file!r} is missing (named by {INDEX_FILE})")
    return files


def checkpoint_entries(path: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every tensor, read from the file headers only."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                yield name, tuple(sl.get_shape()), sl.get_dtype()


def iterate_checkpoint(path: str, targets: dict[str, Target] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) of every tensor of the checkpoint, one file at a time; of a tensor a
    target holds one shard of, only that shard is read."""
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                target = targets.get(name) if targets is not None else None
                shard = target.shard if target is not None else None
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
                    yield name, f.get_slice(name)[index]


# ---- entry points --------------------------------------------------------------------------


def load_checkpoint(model: nn.Module, path: str, targets: dict[str, Target] | None = None) -> list[str]:
    """Load a full checkpoint directory into `model`: validate every header, then copy. Returns
    the names written. `targets`: `checkpoint_targets(model)`, when the caller keeps it."""
    targets = targets if targets is not None else checkpoint_targets(model)
    _validate(model, targets, checkpoint_entries(path), require_all=True)
    return _copy(model, targets, iterate_checkpoint(path, targets))


def load_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the model's own shapes (vLLM's `--load-format dummy`, for benchmarks):
    1-D tensors (norms) 1.0, every other N(0, 0.02) from a generator seeded by (seed, name), so
    that a tensor every tensor-parallel rank holds whole is the same on each."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            p.normal_(0.0, 0.02, generator=gen)


def validate_checkpoint(model: nn.Module, path: str, targets: dict[str, Target] | None = None) -> None:
    """Check every header of a full checkpoint directory against `model` (nothing else is read)."""
    targets = targets if targets is not None else checkpoint_targets(model)
    _validate(model, targets, checkpoint_entries(path), require_all=True)


def validate_entries(
    model: nn.Module, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]], targets: dict[str, Target] | None = None,
) -> dict[str, Target]:
    """Check (name, shape, dtype) entries of a partial update before any byte arrives; returns
    the model's targets by name."""
    targets = targets if targets is not None else checkpoint_targets(model)
    listed = ((name, tuple(shape), _FLOAT_DTYPES.get(dtype, str(dtype))) for name, shape, dtype in entries)
    _validate(model, targets, listed, require_all=False)
    return targets


def load_named_tensors(
    model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]], require_all: bool = False,
    targets: dict[str, Target] | None = None,
) -> list[str]:
    """Copy (checkpoint name, tensor) pairs into `model`: a full set, or a partial update when
    `require_all` is False. Nothing is copied unless every pair is valid. Returns the names
    written."""
    pairs = list(pairs)
    entries = ((name, tuple(t.shape), _FLOAT_DTYPES.get(t.dtype, str(t.dtype))) for name, t in pairs)
    targets = targets if targets is not None else checkpoint_targets(model)
    _validate(model, targets, entries, require_all)
    return _copy(model, targets, pairs)
