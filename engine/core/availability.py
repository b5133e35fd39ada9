"""`Availability`: the one owner of whether the engine serves, and `EngineState`, the value of it
that every control reply (and `Ready`) carries to the client, which renders it and never derives
it again.

Rules:
- New requests are refused (HTTP 503, `EngineState.unavailable` says why) while a memory tag is
  released, while a release drains the running requests, or while the weights were released
  without a host copy and not updated since.
- Waiting requests are admitted into the running batch (`admitting`) unless a weight update or
  a `wait` pause waits for the running requests to finish; they queue meanwhile. A release that drains admits
  them: it waits for every request it accepted before it, queued ones too.
- No step runs (`can_step`) while paused, while any tag is released (one forward touches all
  of them), or while weights discarded by a level-2 sleep are not all written again.
- Weights discarded (vLLM's sleep level 2) stay invalid until an update has written every
  checkpoint tensor: their host copy was freed with them (engine/weights/store.py `drop_host`)
  and is made again, from the device, only once they are all written. A release before that
  (a level 1 after a partial update) keeps them discarded: nothing restores them.
- What the memory regions and the weight store know (tags mapped, pieces missing) is read from
  them, never copied here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from engine.memory.regions import MemoryRegions
    from engine.weights.store import WeightStore


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    """Whether the engine serves, as of a control reply."""

    tags: dict[str, str]  # memory tag -> "resident" | "released"
    paused: bool  # pause_generation: no step runs, new requests queue
    draining: bool  # a release waits for the running requests; new requests are refused
    updating: bool  # a weight update waits for the running requests; new requests queue
    weights_valid: bool  # False: weights released without a host copy and not updated since
    weight_version: str
    unavailable: str | None  # why new requests are refused now (HTTP 503), or None


class Availability:
    def __init__(self, memory: MemoryRegions, weights: WeightStore) -> None:
        self.memory = memory
        self.weights = weights
        self.paused = False
        self.draining = False
        self.updating = False
        self.pausing = False  # a `wait` pause waits for the running requests
        self.weights_discarded = False  # a level-2 sleep: see `discarded`
        # Names the weights in use; RL weight updates set it (SGLang's default is "default").
        self.weight_version = "default"

    @property
    def weights_valid(self) -> bool:
        """Every weight is resident and current, or comes back from the host copy at the next
        forward."""
        return self.weights.missing() == 0 and not self.discarded()

    def discarded(self) -> int:
        """How many checkpoint tensors a level-2 sleep discarded that no update has written since."""
        if not self.weights_discarded:
            return 0
        store = self.weights
        left = sum(1 for i in store.stale if not store.pieces[i].computed)
        self.weights_discarded = left > 0
        return left

    @property
    def admitting(self) -> bool:
        return not self.updating and not self.pausing

    def can_step(self) -> bool:
        return not self.paused and not self.memory.released and not self.discarded()

    def unavailable(self) -> str | None:
        """Why no new request can run now, or None."""
        if self.memory.released:
            return f"memory is released ({', '.join(self.memory.released)}): resume_memory_occupation first"
        if self.draining:
            return "memory is being released"
        discarded = self.discarded()
        if discarded:
            return (f"weights were discarded by a level-2 sleep ({discarded} tensors not written since): "
                    "update the weights first")
        if not self.weights_valid:
            why = ("its host copy, dropped by a level-2 sleep, not made again" if self.weights.host_copy_kind == "discarded"
                   else "--weights-backup none")
            return f"weights were released without a host copy ({why}): update the weights first"
        return None

    def state(self) -> EngineState:
        return EngineState(
            tags=dict(self.memory.state), paused=self.paused, draining=self.draining, updating=self.updating,
            weights_valid=self.weights_valid, weight_version=self.weight_version, unavailable=self.unavailable(),
        )
