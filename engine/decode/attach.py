"""Which kernels a CUDA decode step runs, attached to the model once at startup (the model runner,
inside the `cuda_graph` region, after the attention backend exists):
- steps of few rows: one kernel per layer (fused_decode.py `FusedDecode`), unless their rows hold
  rules.LONG_KV_TOKENS context tokens or more;
- the steps above them, up to 64 rows, and those long ones: two per layer (batch_decode.py `BatchDecode`);
- every other decode step: the layers one op at a time, their attention's rope and K/V store
  folded into one kernel (decode_attention.py `DecodeAttention`).
Each is attached only where the config, the model, its device and the backend allow it; why not
is logged. The model sees them through its hooks (engine/models/hooks.py).

`--deterministic`: none of these (their kernels reduce in their own orders), but the batch decode
in the mode's K order (`BatchDecode(invariant=True)`) for steps of 1 to 64 rows, unless
`--no-batch-decode`.
"""

from __future__ import annotations

import logging

from torch import nn

from engine.attention import AttentionBackend
from engine.config import EngineConfig
from engine.decode import rules
from engine.models.hooks import DecodeAttentionPath, DecodeStepPath

log = logging.getLogger("siesta.engine")


def attach_decode_paths(model: nn.Module, backend: AttentionBackend, config: EngineConfig) -> list[DecodeStepPath]:
    """Attach the decode paths that serve `model` on `backend` (a CUDA model: the kernels are
    Triton's) for steps of at most config.max_num_seqs rows; returns the whole-step paths (their
    owner resets them after a resume)."""
    from engine.decode import batch_decode, decode_attention, fused_decode

    det = config.deterministic  # only the batch decode has a variant in the mode's orders
    attention: DecodeAttentionPath | None = None
    why = "--deterministic" if det else "--no-rope-decode" if not config.rope_decode else decode_attention.unsupported(model, backend)
    if why is None:
        attention = decode_attention.DecodeAttention(model, backend)
    else:
        log.info("rope decode off: %s", why)
    steps: list[DecodeStepPath] = []
    first = 1
    why = "--deterministic" if det else "--no-fused-decode" if not config.fused_decode else fused_decode.unsupported(model, backend)
    if why is None:
        fused = fused_decode.FusedDecode(model, backend, min(fused_decode.MAX_ROWS, config.max_num_seqs))
        steps.append(fused)
        first = fused.max_rows + 1
        log.info("fused decode: steps of <= %d rows run one kernel per layer (%.1f MiB of scratch)",
                 fused.max_rows, fused.nbytes / (1 << 20))
    else:
        log.info("fused decode off: %s", why)
    last = min(batch_decode.MAX_ROWS, config.max_num_seqs)
    why = "--no-batch-decode" if not config.batch_decode else batch_decode.unsupported(model, backend, invariant=det)
    if why is None:  # from one row: the fused kernel's steps at long context (rules.LONG_KV_TOKENS) too
        batch = batch_decode.BatchDecode(model, backend, 1, last, invariant=det)
        steps.append(batch)
        log.info("batch decode%s: steps of %d..%d rows run two kernels per layer, and steps of fewer rows holding "
                 ">= %d context tokens (%.1f MiB of scratch)", " (--deterministic's K order)" if det else "", first,
                 batch.max_rows, rules.LONG_KV_TOKENS, batch.nbytes / (1 << 20))
    else:
        log.info("batch decode off: %s", why)
    model.model.use_decode_paths(steps, attention)
    return steps


def long_kv_rows(steps: list[DecodeStepPath]) -> int:
    """The most rows of a decode step whose path changes at long context (rules.LONG_KV_TOKENS):
    the fused kernel's (its long steps go to the batch decode, or the layers one op at a time:
    split-KV attention either way); 0 without it."""
    from engine.decode import fused_decode

    return max((s.max_rows for s in steps if isinstance(s, fused_decode.FusedDecode)), default=0)
