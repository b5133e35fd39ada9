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
from itertools import accumulate

import msgspec
import torch

from engine.attention import AttentionMetadata
from engine.decode.rules import LONG_KV_TOKENS
from engine.request import Batch, Request
from engine.runner.pinned import PinnedRing
from engine.runner.sampling_plan import SamplingPlan


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


@dataclass
class PendingTokens:
    """The tokens a launched step sampled, still on the device: `token_ids` [S] int64, row j
    belonging to `rows[request]` = j."""

    token_ids: torch.Tensor
    rows: dict[Request, int]


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


class StepPlan(msgspec.Struct, array_like=True):
    """One step as plain numbers: what rank 0 schedules and every tensor-parallel rank runs.
    `parts` are the integer lists uploaded in one copy: input ids, positions, sample indices,
    pending-fill rows and their sources, then the attention metadata (slot_mapping, then the
    int32 fields: query_start_loc, seq_lens, block tables padded to the widest and flattened
    row-major)."""

    parts: list[list[int]]
    num_seqs: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    sample_rows: list[int]  # batch index of each request that samples (again for each of its drafts)
    # Prompt logprobs asked for: (batch index, prompt position q, token row of q - 1), and prompt
    # token q of each (the row's logits score it).
    prompt_logprob_rows: list[tuple[int, int, int]]
    prompt_logprob_targets: list[int]
    sampling: SamplingPlan | None  # None when no row samples
    # The most top alternatives any of those rows asks for (0: their own logprobs only).
    prompt_logprob_top_k: int = 0
    # Some row runs drafts (speculative decoding): more sampling rows than requests, and the next
    # step reads this one's tokens on the host, never from the device.
    drafted: bool = False

    @property
    def long_kv(self) -> bool:
        """A decode step whose rows hold LONG_KV_TOKENS context tokens or more together
        (engine/decode/rules.py: few rows then leave the one-kernel layers)."""
        return self.max_query_len == 1 and sum(self.seq_lens_cpu) >= LONG_KV_TOKENS


_INT32_FIELDS = 3  # the metadata's last parts: query_start_loc, seq_lens, block tables
SLOTS_PART = 5  # StepPlan.parts[SLOTS_PART]: the KV slot of each of the step's tokens, in token order


def plan_step(batch: Batch, block_size: int, pending: PendingTokens | None = None) -> StepPlan:
    """Request i runs its tokens num_computed_tokens .. + num_new_tokens[i]; its KV goes to the
    slots its block table gives; it samples iff that chunk reaches its last token. A chunk ending
    in a pending token (the one decode input the host may not know) reads it from `pending`."""
    decode = _plan_decode(batch, block_size, pending)
    return decode if decode is not None else _plan_any(batch, block_size, pending)


def _plan_decode(batch: Batch, block_size: int, pending: PendingTokens | None) -> StepPlan | None:
    """`plan_step` of a step in which every request runs its last token and samples (a decode
    step: the common one, and the one whose host time grows with the batch), the same plan as
    `_plan_any`'s, built column by column; None for any other step. Such a row asks for no prompt
    logprob: its one token is past the prompt's last scored position."""
    reqs = batch.requests
    starts = [r.num_computed_tokens for r in reqs]
    if not batch.is_decode or any(s + 1 != len(r.token_ids) for s, r in zip(starts, reqs, strict=True)):
        return None
    fill_rows = [i for i, r in enumerate(reqs) if r.num_pending]
    if fill_rows and (pending is None or any(reqs[i].num_pending != 1 or reqs[i] not in pending.rows for i in fill_rows)):
        raise RuntimeError("a decode input token is pending but not in flight")
    fill_from = [pending.rows[reqs[i]] for i in fill_rows] if fill_rows else []
    rows = list(range(len(reqs)))
    meta, meta_values = _metadata_values([s + 1 for s in starts], starts, [r.block_table for r in reqs], block_size)
    return StepPlan(
        parts=[[r.token_ids[-1] for r in reqs], starts, rows, fill_rows, fill_from, *meta_values],
        num_seqs=len(reqs),
        sample_rows=rows,
        prompt_logprob_rows=[],
        prompt_logprob_targets=[],
        sampling=SamplingPlan.from_requests(reqs),
        **meta,
    )


def _plan_any(batch: Batch, block_size: int, pending: PendingTokens | None) -> StepPlan:
    input_ids: list[int] = []
    positions: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    sample_rows: list[int] = []
    sample_indices: list[int] = []
    prompt_rows: list[tuple[int, int, int]] = []
    top_k = 0
    fill_rows: list[int] = []  # token rows whose id is pending ...
    fill_from: list[int] = []  # ... and the row of `pending.token_ids` that holds it
    offsets: list[int] = []  # per sampling row: which of its request's new tokens it samples (drafts: 0..d)
    for i, req in enumerate(batch.requests):
        start = req.num_computed_tokens
        drafts = batch.drafts.get(i, [])
        end = start + batch.num_new_tokens[i] - len(drafts)  # the known and pending tokens' end
        if req.prompt_logprobs:
            first = max(req.sampling_params.logprob_start_len, 1, start + 1)
            last = min(end, req.num_prompt_tokens - 1)
            prompt_rows += [(i, q, len(input_ids) + q - 1 - start) for q in range(first, last + 1)]
            if first <= last:
                top_k = max(top_k, req.sampling_params.top_logprobs_num)
        input_ids += req.token_ids[start:end]
        if end > req.num_known_tokens:
            if pending is None or req not in pending.rows or end - req.num_known_tokens != 1:
                raise RuntimeError(f"request {req.request_id}: an input token is pending but not in flight")
            fill_rows.append(len(input_ids) - 1)
            fill_from.append(pending.rows[req])
        input_ids += drafts
        positions += range(start, end + len(drafts))
        starts.append(start)
        ends.append(end + len(drafts))
        if batch.samples(i):  # with drafts: at its last known token and at each draft
            sample_rows += [i] * (1 + len(drafts))
            sample_indices += range(len(input_ids) - 1 - len(drafts), len(input_ids))
            offsets += range(1 + len(drafts))
    tables = [r.block_table for r in batch.requests]
    meta, meta_values = _metadata_values(ends, starts, tables, block_size)
    sampling = SamplingPlan.from_requests([batch.requests[i] for i in sample_rows], offsets) if sample_rows else None
    return StepPlan(
        parts=[input_ids, positions, sample_indices, fill_rows, fill_from, *meta_values],
        num_seqs=len(tables),
        sample_rows=sample_rows,
        prompt_logprob_rows=prompt_rows,
        prompt_logprob_targets=[batch.requests[i].token_ids[q] for i, q, _ in prompt_rows],
        sampling=sampling,
        prompt_logprob_top_k=top_k,
        drafted=bool(batch.drafts),
        **meta,
    )


def mixed_plan(block_size: int, num_blocks: int) -> StepPlan:
    """A step of a two-token prompt beside one decode (a sequence's second token), in blocks 0 and
    1, sampling nothing: run at startup so that the kernels only mixed steps launch compile then,
    not at the first prompt that joins running decodes (~1 s in which every stream stalls)."""
    ends, starts = [2, 2], [0, 1]
    meta, values = _metadata_values(ends, starts, [[0], [min(1, num_blocks - 1)]], block_size)
    return StepPlan(
        parts=[[0, 0, 0], [0, 1, 1], [], [], [], *values], num_seqs=2, sample_rows=[], prompt_logprob_rows=[],
        prompt_logprob_targets=[], sampling=None, **meta,
    )  # fmt: skip


def step_inputs(plan: StepPlan, upload: Uploader, pending_tokens: torch.Tensor | None = None) -> StepInputs:
    """The plan on the device, in one copy; pending input ids taken from `pending_tokens` (the
    previous step's sampled tokens [S] on the device)."""
    views = upload(plan.parts, int32_tail=_INT32_FIELDS)
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
    meta, values = _metadata_values(ends, starts, tables, block_size)
    slots, qsl, seq_lens, tables_flat = upload(values, int32_tail=_INT32_FIELDS)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables_flat.view(len(tables), -1),
        slot_mapping=slots,
        **meta,
    )


def _metadata_values(
    ends: list[int], starts: list[int], tables: list[list[int]], block_size: int
) -> tuple[dict, list[list[int]]]:
    """(the host-side metadata fields, the integer lists to upload: slot_mapping, then the
    _INT32_FIELDS int32 ones: query_start_loc, seq_lens, block tables padded with 0 to the widest
    and flattened row-major)."""
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    query_start = [0, *accumulate(lengths)]
    slots = slot_mapping(starts, ends, tables, block_size)
    host_fields = {
        "query_start_loc_cpu": query_start,
        "seq_lens_cpu": list(ends),
        "max_query_len": max(lengths),
        "max_seq_len": max(ends),
    }
    return host_fields, [slots, query_start, list(ends), _padded(tables)]


def slot_mapping(starts: list[int], ends: list[int], tables: list[list[int]], block_size: int) -> list[int]:
    """The KV slot of each new token, sequence by sequence: position p of sequence i goes to
    tables[i][p // block_size] * block_size + p % block_size. Built a block's run at a time (a
    512-token chunk is 32 ranges, not 512 Python steps)."""
    slots: list[int] = []
    for s, e, t in zip(starts, ends, tables, strict=True):
        if e - s == 1:  # a decode's token
            slots.append(t[s // block_size] * block_size + s % block_size)
            continue
        if e <= s:
            continue
        first, offset = divmod(s, block_size)
        last = (e - 1) // block_size
        base = t[first] * block_size
        if first == last:  # a chunk inside one block
            slots += range(base + offset, base + offset + e - s)
            continue
        slots += range(base + offset, base + block_size)
        for block in t[first + 1 : last]:
            base = block * block_size
            slots += range(base, base + block_size)
        base = t[last] * block_size
        slots += range(base, base + e - last * block_size)
    return slots


def _padded(tables: list[list[int]]) -> list[int]:
    """Block tables padded with 0 to the widest, flattened row-major."""
    width = max(map(len, tables))
    zeros = [0] * width
    padded: list[int] = []
    for t in tables:
        padded += t
        padded += zeros[len(t) :]
    return padded
