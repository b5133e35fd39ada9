"""Request bodies of the SGLang-native routes, with SGLang's field names so RL clients work
unchanged. Unknown fields in `sampling_params` are refused (a typo must not silently sample with
defaults); unknown top-level fields are ignored, as SGLang does, since clients send extras.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.request import SamplingParams


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    n: int = Field(default=1, description="samples per prompt")

    def to_engine(self, logprobs: bool, top_logprobs_num: int) -> SamplingParams:
        """Engine params; raises `InvalidRequest` naming the bad value."""
        fields = self.model_dump(exclude={"n"})
        fields["stop"] = fields["stop"] or ()
        fields["stop_token_ids"] = fields["stop_token_ids"] or ()
        return SamplingParams(**fields, logprobs=logprobs, top_logprobs_num=top_logprobs_num)


class GenerateRequest(BaseModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    rid: str | list[str] | None = None
    stream: bool = False


class AbortRequestIn(BaseModel):
    rid: str | None = None
    abort_all: bool = False


class PauseGenerationIn(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"
