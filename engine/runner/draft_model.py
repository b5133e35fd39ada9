"""`DraftModel`: speculative decoding's draft model (`--speculative-algorithm draft` with
`--speculative-draft-model-path`; SGLang's STANDALONE, vLLM's `draft_model`): a small causal LM
of the target's vocabulary that proposes a drafting request's next k tokens, greedily; the
target verifies them (engine/core/drafts.py's rules), so the tokens are plain decoding's whatever
the draft proposes.

Where it lives:
- Weights: the target model's submodule `draft`, so they ride in the target's one `weights`
  allocation and every weight call names them `draft.<the draft's checkpoint name>`. Loaded from
  their own directory at startup; updated by `draft.`-named tensors through any update route;
  released and resumed with the target's. A full checkpoint of the target need not hold them,
  and without a host copy a release loses them until an update writes them: no drafts meanwhile
  (engine/weights/loader.py OPTIONAL_PREFIX, engine/weights/store.py `lost`).
- KV cache: a tensor of its own in the `kv_cache` region with the target's block count and
  size. A request's block table and slots address both caches, so a block costs the bytes of
  both (engine/runner/kv_sizing.py).

A proposal for requests whose tokens are all known (n = num_tokens - 1 computed by the target):
1. Catch-up: forwards over each request's tokens from `valid` (positions whose draft KV holds
   the request's own tokens, at most n) through n, at most `chunk` tokens a forward; the last
   row of a request gives draft 1.
2. k - 1 forwards of one row per request: draft j - 1 at position n + j - 1 gives draft j.
The draft KV then holds the request's tokens through n and drafts 1..k-1 at n+1..n+k-1; the
next proposal keeps those the request's tokens confirm. A preemption (new blocks) starts it over
at 0. A wrong or stale draft KV costs acceptance only. One tensor-parallel rank.

With decode graphs (`graphs`, GraphSizes.draft_rows): the forwards are replays. The catch-up's
tokens, where they fit the largest graph (1 or 2 a request once drafting runs: the bonus token,
and the last draft when all were taken), run as rows, each a sequence of its own over the
request's block table, of length position + 1: with a request of two, as a verify step's rows
(step_plan.py `_plan_verify`; ForwardContext.verify), else as a decode step's, through the decode
paths; a longer catch-up (a prompt) runs eagerly. Each step of
(2) is a replay of one row a request whose input token is the one the replay before sampled for
it, read on the device (GraphIO's pending rows). One read of the drafts at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention import AttentionBackend, ForwardContext
from engine.config import ModelConfig
from engine.memory.kv_budget import kv_block_bytes, make_kv_cache
from engine.request import Request
from engine.runner.step_inputs import Uploader, build_metadata
from engine.runner.step_plan import holds_long_kv, metadata_values

if TYPE_CHECKING:
    from engine.models.hooks import DecodeStepPath
    from engine.runner.cuda_graph import CudaGraphRunner


@dataclass
class _Held:
    """What one request's draft KV holds: its own tokens below `base`, then `drafts` (positions
    base, base + 1, ...), written while its blocks were those of preemption count `preemptions`."""

    base: int
    drafts: list[int]
    preemptions: int


class DraftModel:
    def __init__(self, model: nn.Module, config: ModelConfig, block_size: int, chunk: int) -> None:
        """`model`: the draft, built on the meta device and attached as the target's `draft`
        before the target's WeightStore binds both (ModelRunner's startup)."""
        self.model, self.config = model, config
        self.block_size, self.chunk = block_size, chunk
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        self.graphs: CudaGraphRunner | None = None
        self.decode_paths: list[DecodeStepPath] = []  # the target's kinds, over its own backend (decode/attach.py)
        self._held: dict[str, _Held] = {}

    def block_bytes(self, dtype: torch.dtype) -> int:
        """Draft KV bytes of one block (added to the target's when the cache is sized)."""
        return kv_block_bytes(self.config, self.block_size, dtype)

    def allocate_cache(self, num_blocks: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Its KV cache [layers, K/V, num_blocks, block_size, kv_heads, head_dim] (inside the
        caller's `kv_cache` region)."""
        self.kv_cache = make_kv_cache(self.config, num_blocks, self.block_size, dtype, device)
        return self.kv_cache

    def make_graphs(self, rows: int, verify: bool, device: torch.device, pool: Any,
                    long_kv_rows: int = 0) -> CudaGraphRunner:  # fmt: skip
        """Its decode graphs of up to `rows` rows over its backend (verify graphs of as many rows
        where `verify`, long-context ones up to `long_kv_rows`: the target's rules), sharing
        the target's `pool`; built inside the caller's `cuda_graph` region, captured by the caller."""
        from engine.runner.cuda_graph import CudaGraphRunner

        assert self.backend is not None, "the draft's backend comes with the KV cache"
        self.graphs = CudaGraphRunner(self.model, self.backend, rows, self.config.vocab_size, device, pool=pool,
                                      long_kv_rows=long_kv_rows, verify_rows=rows if verify else 0)  # fmt: skip
        return self.graphs

    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int], upload: Uploader) -> list[list[int]]:
        """Drafts of ks[i] tokens for requests[i] (module docstring, steps 1-2); every request's
        tokens known, its blocks covering positions through n + ks[i] - 1."""
        assert self.backend is not None, "the draft's cache and backend come with the KV cache"
        if len(self._held) > 4 * max(len(requests), 16):  # requests aborted or finished away
            self._held = {r.request_id: self._held[r.request_id] for r in requests if r.request_id in self._held}
        ends = [r.num_tokens for r in requests]  # catch-up through position n = num_tokens - 1
        starts = [min(self._valid(r), end - 1) for r, end in zip(requests, ends, strict=True)]
        if self.graphs is not None:
            drafts = self._replayed(requests, ks, starts, ends, upload)
        else:
            drafts = self._eager(requests, ks, starts, ends, upload)
        for req, end, d in zip(requests, ends, drafts, strict=True):
            self._held[req.request_id] = _Held(end, d[:-1], req.num_preemptions)
        return drafts

    def _eager(self, requests: list[Request], ks: list[int], starts: list[int], ends: list[int],
               upload: Uploader) -> list[list[int]]:  # fmt: skip
        """`propose`'s forwards, eagerly: each forward's tokens feed the next on the device."""
        samples = [self._catch_up(requests, starts, ends, upload)]  # [R]
        picks = [{i: i for i in range(len(requests))}]
        for j in range(1, max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > j]  # draft j of these (their blocks hold its KV)
            prev = samples[-1]
            feed = prev if len(rows) == prev.numel() else prev[upload([[picks[-1][i] for i in rows]])[0]]
            pos = [ends[i] - 1 + j for i in rows]
            samples.append(self._forward([requests[i] for i in rows], feed, pos, [p + 1 for p in pos], upload))
            picks.append({i: r for r, i in enumerate(rows)})
        return _drafts(samples, picks, len(requests))

    def _replayed(self, requests: list[Request], ks: list[int], starts: list[int], ends: list[int],
                  upload: Uploader) -> list[list[int]]:  # fmt: skip
        """`propose`'s forwards as graph replays (module docstring); their samples stay in the
        graphs' `io.tokens` until the next replay, a copy of each kept for the one read."""
        graphs = self.graphs
        assert graphs is not None
        cells = [(i, p) for i, (s, e) in enumerate(zip(starts, ends, strict=True)) for p in range(s, e)]
        if len(cells) <= graphs.max_bs:
            ids = [requests[i].token_ids[p] for i, p in cells]
            # One row a request (a draft was rejected: the bonus token alone) is a decode step's
            # row, which the decode paths serve; a request's second row reads the K/V its first
            # stores in the same forward: verify rows.
            verify = any(e - s > 1 for s, e in zip(starts, ends, strict=True))
            graphs.replay(self._rows(requests, cells, ids, []), [1.0] * len(cells), len(cells), verify=verify,
                          long_kv=not verify and holds_long_kv([p + 1 for _, p in cells]))  # fmt: skip
            samples = [graphs.io.tokens[: len(cells)].clone()]
            picks = [{i: r for r, (i, _) in enumerate(cells)}]  # a request's last row samples its draft 1
        else:
            samples = [graphs.io.keep(self._catch_up(requests, starts, ends, upload)).clone()]
            picks = [{i: i for i in range(len(requests))}]
        for j in range(1, max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > j]
            cells = [(i, ends[i] - 1 + j) for i in rows]  # draft j - 1 at position n + j - 1
            sources = [picks[-1][i] for i in rows]  # where the last replay left each row's input
            graphs.replay(self._rows(requests, cells, [0] * len(rows), sources), [1.0] * len(rows), len(rows),
                          long_kv=holds_long_kv([p + 1 for _, p in cells]))  # fmt: skip
            samples.append(graphs.io.tokens[: len(rows)].clone())
            picks.append({i: r for r, i in enumerate(rows)})
        return _drafts(samples, picks, len(requests))

    def _rows(self, requests: list[Request], cells: list[tuple[int, int]], ids: list[int],
              sources: list[int]) -> list[list[int]]:  # fmt: skip
        """A graph step's parts (StepPlan's order) of one row a (request, position) cell, each a
        sequence of its own of length position + 1 over the request's block table; `sources`
        (one a row, or none): the rows of the last replay's samples that are their input tokens."""
        positions = [p for _, p in cells]
        tables = [requests[i].block_table for i, _ in cells]
        _, values = metadata_values([p + 1 for p in positions], positions, tables, self.block_size)
        fill_rows = list(range(len(cells))) if sources else []
        return [ids, positions, list(range(len(cells))), fill_rows, sources, *values]

    def after_resume(self) -> None:
        """The caches came back undefined: no request's draft KV holds anything."""
        self._held.clear()
        if self.backend is not None:
            self.backend.after_resume()
        if self.graphs is not None:
            self.graphs.after_resume()
        for path in self.decode_paths:
            path.after_resume()

    def forget(self, request_id: str) -> None:
        """`request_id` is done: nothing of it is kept."""
        self._held.pop(request_id, None)

    def _valid(self, req: Request) -> int:
        """Positions of `req` whose draft KV holds its own tokens."""
        held = self._held.get(req.request_id)
        if held is None or held.preemptions != req.num_preemptions:
            return 0
        real = req.token_ids[held.base : held.base + len(held.drafts)]
        same = next((i for i, (a, b) in enumerate(zip(real, held.drafts, strict=False)) if a != b), min(len(real), len(held.drafts)))
        return held.base + same

    def _catch_up(self, requests: list[Request], starts: list[int], ends: list[int], upload: Uploader) -> torch.Tensor:
        """Forwards over tokens starts[i]..ends[i]-1 of each request, at most `chunk` tokens
        each: [R] the argmax after each request's last token, on the device."""
        first: list[torch.Tensor | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        at = list(starts)
        while todo:
            rows, spans, budget = [], [], self.chunk
            for i in todo:
                take = min(ends[i] - at[i], budget)
                if take <= 0:
                    break
                rows.append(i)
                spans.append((at[i], at[i] + take))
                budget -= take
            reqs = [requests[i] for i in rows]
            ids = upload([[t for r, (s, e) in zip(reqs, spans, strict=True) for t in r.token_ids[s:e]]])[0]
            tokens = self._forward(reqs, ids, [s for s, _ in spans], [e for _, e in spans], upload)
            for j, (i, (_, e)) in enumerate(zip(rows, spans, strict=True)):
                at[i] = e
                if e == ends[i]:
                    first[i] = tokens[j : j + 1]
            todo = [i for i in todo if at[i] < ends[i]]
        return torch.cat(first)  # type: ignore[arg-type]

    def _forward(self, reqs: list[Request], input_ids: torch.Tensor, starts: list[int], ends: list[int],
                 upload: Uploader) -> torch.Tensor:  # fmt: skip
        """One forward of input_ids [T] (sequence i's at positions starts[i]..ends[i]-1 of
        reqs[i], its KV into their blocks): [R] the argmax after each sequence's last token."""
        meta = build_metadata(ends, starts, [r.block_table for r in reqs], self.block_size, upload)
        (positions,) = upload([[p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]])
        hidden = self.model(input_ids, positions, ForwardContext(self.backend, meta))
        (last,) = upload([[q - 1 for q in meta.query_start_loc_cpu[1:]]])
        return self.model.compute_logits(hidden[last]).argmax(dim=-1)


def _drafts(samples: list[torch.Tensor], picks: list[dict[int, int]], num_requests: int) -> list[list[int]]:
    """Each request's drafts, one a forward: forward f's sampled tokens samples[f] [rows], row
    picks[f][i] request i's; one read of them all."""
    flat = torch.cat(samples).tolist()
    drafts: list[list[int]] = [[] for _ in range(num_requests)]
    at = 0
    for sample, pick in zip(samples, picks, strict=True):
        for i, r in pick.items():
            drafts[i].append(flat[at + r])
        at += sample.numel()
    return drafts
