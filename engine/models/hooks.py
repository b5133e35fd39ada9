"""The two places a model hands a step to a faster path it does not know: engine/decode/ builds
the paths and the model runner attaches them at startup (`DecoderModel.use_decode_paths`). A
model never imports engine/decode/; these Protocols are all it knows of it.

Rules: a hook answers `applies` from the step's shapes alone (no device read), and a path that
applies computes exactly what the model's own modules compute, up to the order of fp32 sums. A
path that stores a row's K/V and reads others' in one kernel declines a verify step's rows
(ForwardContext.verify).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from engine.attention import ForwardContext
from engine.models.rotary import RopeInputs


class DecodeStepPath(Protocol):
    """A whole decode step of the decoder's layers: input ids [T] -> the final norm's output
    [T, hidden] (engine/decode/fused_decode.py, batch_decode.py)."""

    def applies(self, input_ids: torch.Tensor, ctx: ForwardContext) -> bool: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def after_resume(self) -> None: ...


class DecodeAttentionPath(Protocol):
    """One layer's attention of a decode step from the layer's input [T, hidden] -> [T, H, D]: its
    qkv projection (with the layer's weights) and attention, the new K/V rows stored
    (engine/decode/decode_attention.py)."""

    def applies(self, hidden: torch.Tensor, ctx: ForwardContext) -> bool: ...

    def __call__(self, attn: nn.Module, hidden: torch.Tensor, rope: RopeInputs, ctx: ForwardContext) -> torch.Tensor: ...
