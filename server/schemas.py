"""Request bodies of the SGLang-native routes, with SGLang's field names so RL clients work
unchanged. Unknown fields in `sampling_params` are refused (a typo must not silently sample with
defaults); unknown top-level fields are ignored, as SGLang does, since clients send extras.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from engine.request import SamplingParams

# Set from the request's top level (`return_logprob`, `top_logprobs_num`), not sampling_params.
_TOP_LEVEL = frozenset({"logprobs", "top_logprobs_num", "logprob_start_len"})
# Integers the engine sees fit in 64 bits (its messages are msgspec: a larger int is a 500 there).
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# The most samples per prompt (`n`): make_jobs builds them all at once.
MAX_N = 1024
# JSON shapes of fields whose engine type is a tuple: a string or a list.
_JSON_TYPES: dict[str, Any] = {"stop": str | list[str] | None, "stop_token_ids": list[Int64] | None}
_INT_TYPES: dict[Any, Any] = {int: Int64, int | None: Int64 | None}


def _sampling_fields() -> dict[str, Any]:
    """`sampling_params`' fields: the engine's SamplingParams (one source of defaults) plus `n`."""
    hints = typing.get_type_hints(SamplingParams)
    fields: dict[str, Any] = {
        f.name: (_JSON_TYPES[f.name], None) if f.name in _JSON_TYPES
        else (_INT_TYPES.get(hints[f.name], hints[f.name]), f.default)
        for f in dataclasses.fields(SamplingParams)
        if f.name not in _TOP_LEVEL
    }
    return fields | {"n": (int, Field(default=1, le=MAX_N, description="samples per prompt"))}


class _SamplingBase(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def to_engine(self, logprobs: bool, top_logprobs_num: int, logprob_start_len: int = -1) -> SamplingParams:
        """Engine params; raises `InvalidRequest` naming the bad value."""
        fields = self.model_dump(exclude={"n"})
        fields["stop"] = fields["stop"] or ()
        fields["stop_token_ids"] = fields["stop_token_ids"] or ()
        return SamplingParams(
            **fields, logprobs=logprobs, top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len
        )


SamplingParamsIn = create_model("SamplingParamsIn", __base__=_SamplingBase, **_sampling_fields())


class GenerateRequest(BaseModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    return_logprob: bool = False
    top_logprobs_num: Int64 = 0
    logprob_start_len: Int64 = -1  # with return_logprob: input_token_logprobs from this prompt position
    rid: str | list[str] | None = None
    stream: bool = False


class AbortRequestIn(BaseModel):
    rid: str | None = None
    abort_all: bool = False


class PauseGenerationIn(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ReleaseMemoryIn(BaseModel):
    tags: list[str] | None = None  # null or []: all of weights, kv_cache, cuda_graph
    mode: Literal["wait", "abort"] = "wait"


class ResumeMemoryIn(BaseModel):
    tags: list[str] | None = None
    # Wait up to this long for a trainer to free the device before answering 503.
    wait_for_memory_s: float = Field(default=0.0, ge=0.0, le=600.0)
