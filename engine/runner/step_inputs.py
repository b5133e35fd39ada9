"""`StepInputs`: one step's batch as device tensors (token ids, positions, attention metadata,
which rows sample), built on the host and sent to the device in ONE copy.

Rule: every integer the step needs is packed into one int64 host buffer (an `array`, no Python
int list of the whole), copied once (on CUDA from a pinned staging buffer, asynchronously), and
sliced into views there; the int32 fields, packed last, are cast on the device in one launch.
Nothing here waits for the device: the next step is packed while the previous one runs (overlap
scheduling), so a staging buffer is reused only once the copy that last read it has finished,
and an input token the host does not know yet (`PENDING_TOKEN`) is taken on the device from the
previous step's sampled tokens.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.runner.pinned import PinnedRing
from engine.runner.step_plan import INT32_FIELDS, StepPlan, metadata_values


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # batch index of each request that samples (again for each of its drafts) this step
    sample_indices: torch.Tensor  # [S] int64: token row of each sampling request's last token
    # Prompt logprobs asked for: (batch index, prompt position q, token row of q - 1); the row's
    # logits score prompt token q.
    prompt_logprob_rows: list[tuple[int, int, int]]


# Alignment of every part of an upload on the device, bytes, and in elements: a part starts at a
# multiple of 4 elements, so its int32 cast starts 16-byte aligned too.
_ALIGN_BYTES = 16
_ALIGN_ELEMENTS = 4


class Uploader:
    """Host-to-device copies of int64 (`__call__`) or float32 (`floats`) data, one copy per call
    through a ring of staging buffers (pinned on CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._staging = PinnedRing(device) if device.type == "cuda" else None

    def __call__(self, parts: list[list[int]], int32_tail: int = 0) -> list[torch.Tensor]:
        """The parts, concatenated into one int64 buffer, copied once; one device view per part,
        the last `int32_tail` of them int32 (one cast of their span)."""
        flat, offsets = self._upload(parts, "q", torch.int64)
        views = [flat[o : o + len(p)] for o, p in zip(offsets, parts, strict=True)]
        if int32_tail:
            first = offsets[-int32_tail]
            narrow = flat[first:].to(torch.int32)
            views[-int32_tail:] = [narrow[o - first : o - first + len(p)] for o, p in zip(offsets[-int32_tail:], parts[-int32_tail:], strict=True)]
        return views

    def floats(self, parts: list[list[float]]) -> list[torch.Tensor]:
        """As `__call__`, in float32."""
        flat, offsets = self._upload(parts, "f", torch.float32)
        return [flat[o : o + len(p)] for o, p in zip(offsets, parts, strict=True)]

    def _upload(self, parts: list[list], typecode: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
        # Each part starts on a 16-byte boundary: Triton specializes a kernel on whether each
        # pointer argument is 16-byte aligned, so views at arbitrary offsets would compile a new
        # kernel variant for some batch shapes in the middle of serving (a cold-cache TTFT spike).
        per = max(_ALIGN_ELEMENTS, _ALIGN_BYTES // dtype.itemsize)
        packed = array(typecode)
        offsets = []
        for part in parts:
            offsets.append(len(packed))
            packed.extend(part)
            packed.extend([0] * (-len(part) % per))
        host = torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)
        return self._copy(host), offsets

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        if self._staging is None:
            return host.to(self.device)
        staging, copied = self._staging.take(host.numel(), host.dtype)
        staging.copy_(host)
        device = staging.to(self.device, non_blocking=True)
        self._staging.record(copied)
        return device


def step_inputs(plan: StepPlan, upload: Uploader, pending_tokens: torch.Tensor | None = None) -> StepInputs:
    """The plan on the device, in one copy; pending input ids taken from `pending_tokens` (the
    previous step's sampled tokens [S] on the device)."""
    views = upload(plan.parts, int32_tail=INT32_FIELDS)
    input_ids, positions, sample_indices, fill_rows, fill_from, slots, qsl, seq_lens, tables_flat = views
    if plan.parts[3]:
        if pending_tokens is None:
            raise RuntimeError("a step takes pending tokens but no step is in flight")
        rows, sources = plan.parts[3], plan.parts[4]
        if len(rows) == len(input_ids) == len(pending_tokens) and rows == sources == list(range(len(rows))):
            input_ids.copy_(pending_tokens)  # steady decode: row i's input is last step's token i
        else:
            input_ids.index_copy_(0, fill_rows, pending_tokens.index_select(0, fill_from))
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        meta=AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables_flat.view(plan.num_seqs, -1),
            slot_mapping=slots,
            query_start_loc_cpu=plan.query_start_loc_cpu,
            seq_lens_cpu=plan.seq_lens_cpu,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
        ),
        sample_rows=plan.sample_rows,
        sample_indices=sample_indices,
        prompt_logprob_rows=plan.prompt_logprob_rows,
    )


def build_metadata(
    ends: list[int], starts: list[int], tables: list[list[int]], block_size: int, upload: Uploader
) -> AttentionMetadata:
    """Metadata of sequences whose tokens starts[i]..ends[i] are new (for a profiling forward)."""
    meta, values = metadata_values(ends, starts, tables, block_size)
    slots, qsl, seq_lens, tables_flat = upload(values, int32_tail=INT32_FIELDS)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables_flat.view(len(tables), -1),
        slot_mapping=slots,
        **meta,
    )
