"""The control calls of the engine: one msgspec struct per call, dispatched by its type
(`EngineCore.call`), and the struct its reply holds (`Call.reply`).

Rules:
- A call runs between steps, in the order calls arrive, with no step in flight; a `read_only`
  call only reports, so it runs with a step in flight.
- A call that answers later (a release draining the requests, an update waiting for them) holds
  the calls after it until it has run, so that calls take effect in the order they arrive: a
  resume sent after a release finds the memory released. A call that is not `in_order` goes
  ahead: the read-only ones, and `Abort` (how a caller frees a release that waits).
- Field names and defaults are SGLang's, so a route builds a call from its JSON body as it is.
- A reply's result is `Call.reply`: a struct where the answer has a fixed shape, a dict where it
  is a report (server info, loads, occupation, checksums, profiles), as SGLang answers them.
  `msgspec.to_builtins(result)` is the JSON a route answers.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

DEFAULT_GROUP = "weight_update_group"
# Integers fit the engine's messages (msgpack: 64 bits); a route that decodes a body straight into
# a call refuses larger ones there.
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# A weight version as clients send it (slime: "3" or 3); the engine keeps it as a string.
WeightVersion = str | Int64 | None


class Call(msgspec.Struct, tag=True, kw_only=True, frozen=True):
    """A control call; `call_id` pairs it with its reply."""

    call_id: int = 0
    read_only: ClassVar[bool] = False
    in_order: ClassVar[bool] = True  # waits behind a call that answers later
    reply: ClassVar[Any] = dict[str, Any]


# ---- replies with a fixed shape ------------------------------------------------------------------


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A reply; fields left at their default are left out of its JSON."""


class PauseReply(Reply):
    paused: bool
    mode: str | None = None
    num_running: int | None = None
    num_waiting: int | None = None


class MemoryReply(Reply):
    """Where every tag stands after a release or resume."""

    tags: dict[str, str]  # tag -> "resident" | "released"
    changed: list[str]
    memory_saver: bool
    weights_valid: bool
    weights_stale_bytes: int
    weights_host_copy: str  # pinned | pageable | discarded (a level-2 release) | none
    weights_host_copy_bytes: int  # rank 0's, as /memory_occupation
    seconds: float
    seconds_by_tag: dict[str, float]
    # With several tensor-parallel ranks: what each did ({tp_rank, bytes, changed}, a release's
    # host_bytes_freed).
    ranks: list[dict[str, Any]] | None = None


class ReleaseReply(MemoryReply, kw_only=True):
    bytes_freed: int  # device bytes, every rank's
    host_bytes_freed: int  # the weights' host copy freed by a level-2 release, every rank's
    host_copy_wait_seconds: float


class ResumeReply(MemoryReply, kw_only=True):
    success: bool
    refused: dict[str, dict[str, int]]  # tag -> {"bytes_needed", "bytes_free"}: left released
    bytes_restored: int


class WeightUpdateReply(Reply):
    success: bool
    message: str
    weight_version: str
    seconds: float
    seconds_by_phase: dict[str, float]
    tags: dict[str, str]
    weights_valid: bool
    receive_route: str | None = None  # a process-group update: how the bytes arrived


class GroupReply(Reply):
    success: bool
    message: str


class VersionReply(Reply):
    success: bool
    message: str
    new_version: str


# ---- the calls -----------------------------------------------------------------------------------


class Ping(Call):
    """Says "resident" or "released"."""

    read_only = True
    in_order = False
    reply = str


class GetInfo(Call):
    read_only = True
    in_order = False


class GetLoad(Call):
    read_only = True
    in_order = False


class GetMemoryOccupation(Call):
    read_only = True
    in_order = False


class FlushCache(Call):
    """Answers False (nothing flushed) while requests hold blocks."""

    reply = bool


class PauseGeneration(Call):
    """`abort` | `retract` | `in_place` (SGLang's) | `wait` (vLLM's: admit no more, answer once
    the running requests finished). `clear_cache` (vLLM's) drops every prefix hash once paused."""

    mode: str = "abort"
    clear_cache: bool = False
    reply = PauseReply


class ContinueGeneration(Call):
    reply = PauseReply


class Abort(Call):
    """Abort the named requests (None: all), with `samples` also the samples of each (`rid#i`,
    engine/request.py SAMPLE_SEP); answers how many were found."""

    request_ids: list[str] | None = None
    samples: bool = False
    in_order = False
    reply = int


class ReleaseMemory(Call):
    """`discard_weights` (vLLM's sleep level 2): released weights come back only from a weight
    update, never from the host copy; until one has written them, only `weights` may resume."""

    tags: list[str] | None = None  # None or []: all
    mode: str = "wait"  # wait | abort
    discard_weights: bool = False
    reply = ReleaseReply


class ResetPrefixCache(Call):
    """vLLM's reset_prefix_cache: every prefix hash dropped (blocks in use keep their KV for their
    requests); with `reset_running_requests`, every request holding KV recomputes it too."""

    reset_running_requests: bool = False
    reply = int  # requests set back to recompute


class ResumeMemory(Call):
    tags: list[str] | None = None
    wait_for_memory_s: float = 0.0
    reply = ResumeReply


class UpdateWeightsFromDisk(Call):
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None
    reply = WeightUpdateReply


class UpdateWeightsFromTensor(Call):
    serialized_named_tensors: list[str]  # one payload per tensor-parallel rank
    load_format: str | None = None  # null | "direct" | "flattened_bucket"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None
    reply = WeightUpdateReply


class InitWeightsUpdateGroup(Call):
    master_address: str
    master_port: Int64
    rank_offset: Int64
    world_size: Int64
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float = 60.0  # each wait of the join and of every later broadcast in the group
    reply = GroupReply


class UpdateWeightsFromDistributed(Call):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[Int64]]
    group_name: str = DEFAULT_GROUP
    # null: one broadcast per tensor | "flattened_bucket": one in all | "packed": vLLM's packed
    # broadcast (its default 1 GiB buckets, engine/weights/updater.py)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = None
    reply = WeightUpdateReply


class UpdateWeightVersion(Call):
    """Name the weights in use without touching them (SGLang's update_weight_version): for a
    trainer that declares its starting checkpoint's version before the first rollout."""

    new_version: str | Int64
    abort_all_requests: bool = False
    reply = VersionReply


class DestroyWeightsUpdateGroup(Call):
    group_name: str = DEFAULT_GROUP
    reply = GroupReply


class CheckWeights(Call):
    action: str = "checksum"  # snapshot | reset_tensors | compare | checksum
    allow_quant_error: bool = False


class StartProfile(Call):
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_id: str | None = None
    profile_prefix: str | None = None


class StopProfile(Call):
    pass


ControlCall = (
    Ping | GetInfo | GetLoad | GetMemoryOccupation | FlushCache | PauseGeneration | ContinueGeneration | Abort
    | ReleaseMemory | ResetPrefixCache | ResumeMemory | UpdateWeightsFromDisk | UpdateWeightsFromTensor | InitWeightsUpdateGroup
    | UpdateWeightsFromDistributed | DestroyWeightsUpdateGroup | UpdateWeightVersion | CheckWeights | StartProfile
    | StopProfile
)
