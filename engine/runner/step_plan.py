"""`StepPlan`: one scheduled step as plain numbers, what rank 0 plans and every tensor-parallel
rank runs (engine/runner/step_inputs.py sends it to the device).

Rules:
- A decode step (every request its last token, every one sampling) is planned column by column
  (`_plan_decode`): the common step, whose host time grows with the batch.
- A drafted step whose requests each run their last token and drafts is planned as decode rows
  (`_plan_verify`), one per token, so that it replays a decode graph: row j of a request is a
  sequence of its own, position start + j, over the request's blocks.
- Any other step (prefill chunks, mixed, drafts beside a chunk) is planned token by token
  (`_plan_any`).
- An input token the host does not know yet is read on the device from the step before's
  samples (`PendingTokens`): its row and source row are in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import msgspec
import torch

from engine.decode.rules import LONG_KV_TOKENS
from engine.request import Batch, Request
from engine.runner.sampling_plan import SamplingPlan


@dataclass
class PendingTokens:
    """The tokens a launched step sampled, still on the device: `token_ids` [S] int64, row j
    belonging to `rows[request]` = j."""

    token_ids: torch.Tensor
    rows: dict[Request, int]



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
    def verify(self) -> bool:
        """A drafted step planned as decode rows (`_plan_verify`): a decode graph's shape."""
        return self.drafted and self.max_query_len == 1

    @property
    def long_kv(self) -> bool:
        """A decode step whose rows hold LONG_KV_TOKENS context tokens or more together."""
        return self.max_query_len == 1 and holds_long_kv(self.seq_lens_cpu)


def holds_long_kv(seq_lens: list[int]) -> bool:
    """Decode rows of these lengths hold LONG_KV_TOKENS context tokens or more together
    (engine/decode/rules.py: few rows then leave the one-kernel layers)."""
    return sum(seq_lens) >= LONG_KV_TOKENS


INT32_FIELDS = 3  # the metadata's last parts: query_start_loc, seq_lens, block tables
SLOTS_PART = 5  # StepPlan.parts[SLOTS_PART]: the KV slot of each of the step's tokens, in token order


def plan_step(
    batch: Batch, block_size: int, pending: PendingTokens | None = None, max_seqs: int | None = None
) -> StepPlan:
    """Request i runs its tokens num_computed_tokens .. + num_new_tokens[i]; its KV goes to the
    slots its block table gives; it samples iff that chunk reaches its last token. A chunk ending
    in a pending token (the one decode input the host may not know) reads it from `pending`.
    `max_seqs`: the most sequences a step's attention metadata may hold (the backend's
    max_num_seqs: its workspaces and graph buffers); a verify step of more rows is planned as
    chunks."""
    if not batch.drafts:
        decode = _plan_decode(batch, block_size, pending)
    elif max_seqs is None or batch.num_tokens <= max_seqs:
        decode = _plan_verify(batch, block_size, pending)
    else:
        decode = None
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
    meta, meta_values = metadata_values([s + 1 for s in starts], starts, [r.block_table for r in reqs], block_size)
    return StepPlan(
        parts=[[r.token_ids[-1] for r in reqs], starts, rows, fill_rows, fill_from, *meta_values],
        num_seqs=len(reqs),
        sample_rows=rows,
        prompt_logprob_rows=[],
        prompt_logprob_targets=[],
        sampling=SamplingPlan.from_requests(reqs),
        **meta,
    )


def _plan_verify(batch: Batch, block_size: int, pending: PendingTokens | None) -> StepPlan | None:
    """`plan_step` of a drafted step in which every request runs its last token and its drafts,
    if any, and samples at each: one decode row per token, as a decode graph runs them. Row j of
    a request (position start + j) is a sequence of its own over the request's block table, of
    length start + j + 1: it attends to the rows before it through the cache, which every backend
    stores before it attends (ForwardContext.verify keeps the decode paths that do not out). The
    samples, offsets and tokens are `_plan_any`'s; None for any other step."""
    reqs = batch.requests
    ids: list[int] = []
    positions: list[int] = []
    tables: list[list[int]] = []
    sample_rows: list[int] = []
    offsets: list[int] = []
    fill_rows: list[int] = []
    fill_from: list[int] = []
    for i, req in enumerate(reqs):
        start, drafts = req.num_computed_tokens, batch.drafts.get(i, [])
        if start + 1 != len(req.token_ids) or batch.num_new_tokens[i] != 1 + len(drafts):
            return None  # (a row at its last token scores no prompt token: the prompt's last is its input)
        if start + 1 > req.num_known_tokens:
            fill_rows.append(len(ids))
            fill_from.append(_pending_source(req, start + 1, pending))
        ids += [req.token_ids[start], *drafts]
        positions += range(start, start + 1 + len(drafts))
        tables += [req.block_table] * (1 + len(drafts))
        sample_rows += [i] * (1 + len(drafts))
        offsets += range(1 + len(drafts))
    meta, meta_values = metadata_values([p + 1 for p in positions], positions, tables, block_size)
    return StepPlan(
        parts=[ids, positions, list(range(len(ids))), fill_rows, fill_from, *meta_values],
        num_seqs=len(ids),
        sample_rows=sample_rows,
        prompt_logprob_rows=[],
        prompt_logprob_targets=[],
        sampling=SamplingPlan.from_requests([reqs[i] for i in sample_rows], offsets),
        drafted=True,
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
            fill_rows.append(len(input_ids) - 1)
            fill_from.append(_pending_source(req, end, pending))
        input_ids += drafts
        positions += range(start, end + len(drafts))
        starts.append(start)
        ends.append(end + len(drafts))
        if batch.samples(i):  # with drafts: at its last known token and at each draft
            sample_rows += [i] * (1 + len(drafts))
            sample_indices += range(len(input_ids) - 1 - len(drafts), len(input_ids))
            offsets += range(1 + len(drafts))
    tables = [r.block_table for r in batch.requests]
    meta, meta_values = metadata_values(ends, starts, tables, block_size)
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


def _pending_source(req: Request, end: int, pending: PendingTokens | None) -> int:
    """The row of `pending.token_ids` that holds `req`'s input token end - 1, which the host does
    not know yet; RuntimeError unless it is the request's one token in flight."""
    if pending is None or req not in pending.rows or end - req.num_known_tokens != 1:
        raise RuntimeError(f"request {req.request_id}: an input token is pending but not in flight")
    return pending.rows[req]


def mixed_plan(block_size: int, num_blocks: int) -> StepPlan:
    """A step of a two-token prompt beside one decode (a sequence's second token), in blocks 0 and
    1, sampling nothing: run at startup so that the kernels only mixed steps launch compile then,
    not at the first prompt that joins running decodes (~1 s in which every stream stalls)."""
    ends, starts = [2, 2], [0, 1]
    meta, values = metadata_values(ends, starts, [[0], [min(1, num_blocks - 1)]], block_size)
    return StepPlan(
        parts=[[0, 0, 0], [0, 1, 1], [], [], [], *values], num_seqs=2, sample_rows=[], prompt_logprob_rows=[],
        prompt_logprob_targets=[], sampling=None, **meta,
    )  # fmt: skip


def metadata_values(
    ends: list[int], starts: list[int], tables: list[list[int]], block_size: int
) -> tuple[dict, list[list[int]]]:
    """(the host-side metadata fields, the integer lists to upload: slot_mapping, then the
    INT32_FIELDS int32 ones: query_start_loc, seq_lens, block tables padded with 0 to the widest
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
