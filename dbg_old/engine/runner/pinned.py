"""`PinnedRing`: pinned host buffers taken in turn for asynchronous copies between host and device.

Rule: a buffer is handed out again only after the copy recorded on it last has finished. The
engine packs step k+1's inputs and reads step k-1's tokens while step k still runs, so one buffer
per direction and dtype is not enough; a ring of two is, since the loop waits for step k-1 before
it launches step k+1.
"""

from __future__ import annotations

import torch

_RING = 2
_MIN_ELEMENTS = 1 << 16


class _Slot:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None


class PinnedRing:
    """CUDA only: host buffers of any dtype, grown on demand and never shrunk, for copies to and
    from `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.index is not None else torch.device(device.type, torch.cuda.current_device())
        self._slots: dict[torch.dtype, list[_Slot]] = {}
        self._turns: dict[torch.dtype, int] = {}

    def record(self, event: torch.cuda.Event) -> None:
        """Record a taken buffer's event on the device's current stream (named: torch's lookup
        of the current device costs the host more than the copy it follows)."""
        event.record(torch.cuda.current_stream(self.device))

    def take(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer [numel] free to fill or to copy into, and the event to `record` right
        after the copy that uses it is enqueued (the slot's own, reused)."""
        slots = self._slots.setdefault(dtype, [_Slot() for _ in range(_RING)])
        turn = self._turns[dtype] = self._turns.get(dtype, 0) + 1
        slot = slots[turn % _RING]
        if slot.event is not None:
            slot.event.synchronize()  # the copy of two turns ago: long done in a running loop
        if slot.buffer is None or slot.buffer.numel() < numel:
            slot.buffer = torch.empty(max(numel, _MIN_ELEMENTS), dtype=dtype, pin_memory=True)
        if slot.event is None:
            slot.event = torch.cuda.Event()
        return slot.buffer[:numel], slot.event
