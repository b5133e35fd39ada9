"""Which kernels a CUDA decode step runs, attached to the model once at startup (the model runner,
inside the `cuda_graph` region, after the attention backend exists):
- steps of few rows: one kernel per layer (engine/models/fused_decode.py `FusedDecode`);
- the steps above them, up to 64 rows: two per layer (engine/models/batch_decode.py `BatchDecode`);
- every other decode step: the layers one op at a time, their attention's rope and K/V store
  folded into one kernel (engine/models/batch_attention.py `DecodeAttention`).
Each is attached only where the model, its device and the backend allow it; why not is logged.
"""

from __future__ import annotations

import logging

from torch import nn

from engine.attention import AttentionBackend

log = logging.getLogger("siesta.engine")


def attach_decode_paths(model: nn.Module, backend: AttentionBackend, max_num_seqs: int) -> None:
    """Attach the decode paths that serve `model` on `backend` (a CUDA model: the kernels are
    Triton's), for steps of at most `max_num_seqs` rows."""
    from engine.models import batch_attention, batch_decode, fused_decode

    lm = model.model
    why = batch_attention.unsupported(model, backend)
    if why is None:
        batch_attention.DecodeAttention(model, backend).attach(model)
    else:
        log.info("rope decode off: %s", why)
    why = fused_decode.unsupported(model, backend)
    if why is None:
        lm.fused_decode = fused_decode.FusedDecode(model, backend, min(fused_decode.MAX_ROWS, max_num_seqs))
        log.info("fused decode: steps of <= %d rows run one kernel per layer (%.1f MiB of scratch)",
                 lm.fused_decode.max_rows, lm.fused_decode.nbytes / (1 << 20))
    else:
        log.info("fused decode off: %s", why)
    first = lm.fused_decode.max_rows + 1 if lm.fused_decode is not None else 1
    last = min(batch_decode.MAX_ROWS, max_num_seqs)
    why = batch_decode.unsupported(model, backend)
    if why is None and first <= last:
        lm.batch_decode = batch_decode.BatchDecode(model, backend, first, last)
        log.info("batch decode: steps of %d..%d rows run two kernels per layer (%.1f MiB of scratch)",
                 first, lm.batch_decode.max_rows, lm.batch_decode.nbytes / (1 << 20))
    elif why is not None:
        log.info("batch decode off: %s", why)
