"""Poison: what a released region loses, made visible. After a real release the driver hands back
pages with undefined contents; a read of them that nothing wrote first is a bug that may pass
unseen (fresh pages are often zero). Poisoned memory makes such a read show.

Rules:
- Floating tensors are filled with NaN: one stale read turns every logit it reaches into NaN.
- Integer and byte tensors are filled with 0xFF bytes (-1 for signed integers): a stale index,
  counter or token id is out of range.
- Where regions are no-ops (a CPU, or a GPU without torch_memory_saver) a release poisons what it
  would have handed back (`MemoryRegions.release`); with `--debug-poison-on-resume` a GPU resume
  poisons the pages it maps again, before the owners reset what they keep there (`after_resume`).
- Owners register what their tags hold (`MemoryRegions.holds`): the KV cache, the weights'
  allocation, the graphs' static buffers and the attention workspaces.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def poison(t: torch.Tensor) -> None:
    """Fill `t` with NaN (floating) or 0xFF bytes (anything else)."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.bool, torch.uint8):
        t.view(torch.uint8).fill_(0xFF)
    else:
        t.fill_(-1)


def tensors_of(owner: object) -> list[torch.Tensor]:
    """The tensors an object keeps as attributes (one level: its static buffers and workspaces)."""
    found: list[torch.Tensor] = []
    for value in vars(owner).values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


def poison_all(tensors: Iterable[torch.Tensor]) -> int:
    """Poison every tensor but pinned host memory (never a region's); returns the bytes poisoned."""
    nbytes = 0
    for t in tensors:
        if t.numel() and not t.is_pinned():
            poison(t)
            nbytes += t.numel() * t.element_size()
    return nbytes
