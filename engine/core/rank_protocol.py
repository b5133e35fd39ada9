"""Messages from rank 0 to the other tensor-parallel ranks (engine/core/ranks.py) and their
replies: one tagged struct per thing a rank does, dispatched by type (`Rank.handle`).

Rank 0 owns every decision (scheduling, availability, when a release or an update runs); a rank
only does its own device's part of it: run a planned step, pause or map its regions, validate and
write its slice of new weights. Each message but `RunStep` is answered by one `RankReply` per rank.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.core import calls
from engine.core.protocol import ControlError
from engine.runner.step_plan import StepPlan

WeightUpdate = calls.UpdateWeightsFromDisk | calls.UpdateWeightsFromTensor | calls.UpdateWeightsFromDistributed


class RunStep(msgspec.Struct, tag=True):
    """Run a step rank 0 planned; no reply (the step's collectives keep the ranks in step)."""

    plan: StepPlan


class ReleaseTags(msgspec.Struct, tag=True):
    """Pause these regions (the weights made stale first, their host copy complete); with
    `drop_host` and `weights` (a level-2 release) the weights' host copy is freed instead."""

    tags: list[str]
    drop_host: bool = False


class PlanResume(msgspec.Struct, tag=True):
    """Which of these released tags the device has no room for now: {tag: {bytes_needed, bytes_free}}."""

    tags: list[str]


class ResumeTags(msgspec.Struct, tag=True):
    tags: list[str]


class ValidateUpdate(msgspec.Struct, tag=True):
    """Check an update against this rank's model before any rank writes a byte (a tensor payload
    is decoded and kept for `ApplyUpdate`)."""

    update: WeightUpdate


class ApplyUpdate(msgspec.Struct, tag=True):
    """Write the update validated last: answers its phases' seconds and how the bytes came."""

    update: WeightUpdate


class AbortUpdate(msgspec.Struct, tag=True):
    """An update failed on some rank: a staged payload is dropped, and these pieces (None: every
    one) are stale again, so the next forward restores the old weights from the host copy."""

    names: list[str] | None


class CheckWeights(msgspec.Struct, tag=True):
    """One `/weights_checker` action on this rank's tensors (engine/weights/checker.py)."""

    action: str


class JoinGroup(msgspec.Struct, tag=True):
    call: calls.InitWeightsUpdateGroup


class LeaveGroup(msgspec.Struct, tag=True):
    group_name: str


class DescribeMemory(msgspec.Struct, tag=True):
    """This rank's regions, host copy and device memory (`/get_memory_occupation` per rank)."""


class AfterReply(msgspec.Struct, tag=True):
    """The control call's answer is out: start the host-copy refresh, free finished receives."""


class StopRank(msgspec.Struct, tag=True):
    pass


ToRank = (
    RunStep | ReleaseTags | PlanResume | ResumeTags | ValidateUpdate | ApplyUpdate | AbortUpdate | CheckWeights
    | JoinGroup | LeaveGroup | DescribeMemory | AfterReply | StopRank
)


class RankReady(msgspec.Struct, tag=True):
    rank: int


class RankFailed(msgspec.Struct, tag=True):
    rank: int
    error: str


class RankReply(msgspec.Struct, tag=True):
    rank: int
    result: Any = None
    error: ControlError | None = None


FromRank = RankReady | RankFailed | RankReply
