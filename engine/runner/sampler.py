"""Turning one step's logits into tokens: penalties, logit bias, min_new_tokens, logprobs, greedy,
temperature, top-k, top-p, min-p and per-request seeds.

Everything runs on the logits' device with batched tensor ops; `Sampler.sample` launches it all
without waiting (the inputs come through the asynchronous `Uploader`), and the only host sync
is `SampledOnDevice.wait`, which reads the results. Per-row choices that change the work done
(any penalties? any sampled rows? any top-k?) are Python flags on `SamplingBatch`, known without
looking at a tensor.

Order, per row: penalties, then logit_bias (added, as SGLang), then the result held to
|x| <= LOGIT_LIMIT (a huge penalty or bias overflows float32; held there, x / T stays finite for
every T >= SAMPLING_EPS, so no logprob is NaN), then min_new_tokens masking, then the grammar's
mask (engine/runner/grammar.py: a disallowed token is -inf), then logprobs =
log_softmax(logits / T) (T below SAMPLING_EPS counts as 1; computed as x - logsumexp(x) for the
tokens reported, never over the whole [B, V]: engine/kernels/lse_argmax.py on CUDA), then greedy
rows take the argmax and the others divide by T, truncate (top-k, top-p, min-p) and sample with
an exponential race: argmax(probs / q), q ~ Exp(1) i.i.d., picks token i with probability
probs[i] / sum(probs), and lets a row draw q from its own generator.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from engine.request import FLOAT32_MAX, SAMPLING_EPS
from engine.runner.pinned import PinnedRing
from engine.runner.sampling_batch import SamplingBatch

LOGIT_LIMIT = FLOAT32_MAX * SAMPLING_EPS  # processed logits stay within +-this (rule above)


@dataclass
class SamplerOutput:
    """Per row: the sampled token, its logprob, and (when any row asked) its top logprobs, best
    first, `top_logprobs_num` of them (an empty list for rows that asked for none)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


class SampledOnDevice:
    """A step's samples, launched and not yet read: `token_ids` [B] int64 on the device (the next
    step's inputs can take them from there); `wait()` reads the results on the host."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        packed: torch.Tensor,  # [B, 2 + 2 * n_top] float64: token, logprob, top values, top ids
        top_logprobs_nums: list[int],
        pinned: PinnedRing | None,
    ) -> None:
        self.token_ids = token_ids
        self._top_nums = top_logprobs_nums
        self._n_top = (packed.shape[1] - 2) // 2
        self._host = packed
        self._copied: torch.cuda.Event | None = None
        if pinned is not None:  # on CUDA: one asynchronous copy into a pinned buffer
            buffer, self._copied = pinned.take(packed.numel(), packed.dtype)
            self._host = buffer.view(packed.shape)
            self._host.copy_(packed, non_blocking=True)
            pinned.record(self._copied)

    @classmethod
    def landed(cls, token_ids: torch.Tensor, host: torch.Tensor, done: torch.cuda.Event) -> SampledOnDevice:
        """Greedy samples whose (token, logprob) rows [B, 2] float64 a kernel writes straight
        into pinned `host` (engine/runner/graph_io.py): readable once `done` has passed."""
        out = cls(token_ids, host, [0] * host.shape[0], None)
        out._copied = done
        return out

    def wait(self) -> SamplerOutput:
        """The step's results on the host: the step's only host sync (ids < 2**53 stay exact)."""
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host.tolist()
        n_top = self._n_top
        return SamplerOutput(
            token_ids=[int(row[0]) for row in rows],
            logprobs=[row[1] for row in rows],
            top_logprobs=None
            if n_top == 0
            else [
                [(int(row[2 + n_top + j]), row[2 + j]) for j in range(n)]
                for row, n in zip(rows, self._top_nums, strict=True)
            ],
        )


class Sampler:
    """Samples one token per row. Rows without a seed share the generator seeded with `seed`."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._row_generator = torch.Generator(device=self.device)  # re-seeded for each seeded row
        self._pinned = PinnedRing(self.device) if self.device.type == "cuda" else None  # results' landing
        # lse_argmax's per-row counters, zero between calls; outside the memory regions, so a
        # resume never hands them back as garbage. None: torch's logsumexp and argmax (CPU).
        fast = self.device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self._counts = torch.zeros(256, dtype=torch.int32, device=self.device) if fast else None
        self.seeded_kernel = fast  # seeded rows' noise in one launch (kernels/seeded_noise.py), else a generator per row

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).wait()

    def sample(
        self, logits: torch.Tensor, batch: SamplingBatch,
        lse_argmax: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> SampledOnDevice:  # fmt: skip
        """Launch the sampling of `logits` [B, V]; nothing here waits for the device. `lse_argmax`:
        `_lse_argmax`'s answer for these logits and temperatures, already computed (a decode
        graph's), used only where no penalty, bias or ban changes the logits."""
        unchanged = logits
        logits = self.process_logits(logits, batch)  # [B, V]
        temps = batch.temperatures  # [B] float32
        n_top = max(batch.top_logprobs_nums, default=0)
        # [B, V] float32 logits / T (half logits promote), built only where the step needs it all
        scaled = None
        if not batch.all_greedy or n_top > 0 or self._counts is None:
            scaled = torch.div(logits, temps[:, None])
        # [B] each, of logits / T; pairs [B, 2] (argmax, its logprob) on CUDA, else None
        if lse_argmax is not None and logits is unchanged:
            lse, tokens, pairs = lse_argmax
        else:
            lse, tokens, pairs = self._lse_argmax(logits, temps, scaled)
        if scaled is not None and not batch.all_greedy:
            probs = torch.softmax(self._truncate(scaled, batch), dim=-1)  # [B, V], 0 where cut
            if batch.use_min_p:
                # Relative to the row's best token, so no renormalisation is needed first or after.
                cut = probs < batch.min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
                probs = probs.masked_fill(cut, 0.0)
            sampled = (probs / self._exponential_noise(probs, batch)).argmax(dim=-1)  # [B]
            assert batch.greedy is not None
            tokens = torch.where(batch.greedy, tokens, sampled)
            pairs = None
        if pairs is None:
            # the chosen token's x / T, the same division as `scaled`'s
            chosen = torch.div(logits.gather(1, tokens[:, None]), temps[:, None])
            pairs = torch.cat([tokens[:, None].double(), (chosen - lse[:, None]).double()], dim=1)
        if n_top > 0:
            assert scaled is not None
            top_values, top_ids = scaled.topk(n_top, dim=-1)  # [B, n_top] each
            pairs = torch.cat([pairs, (top_values - lse[:, None]).double(), top_ids.double()], dim=1)
        return SampledOnDevice(tokens, pairs, batch.top_logprobs_nums, self._pinned)

    def _lse_argmax(
        self, logits: torch.Tensor, temps: torch.Tensor, scaled: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logsumexp [B], first argmax [B], the argmax rows' (token, logprob) [B, 2] float64 or
        None) of logits [B, V] / temps [B] in float32: one read of the logits on CUDA, torch's
        ops on `scaled` (their quotient) elsewhere."""
        if self._counts is None:
            assert scaled is not None
            return torch.logsumexp(scaled, dim=-1), scaled.argmax(dim=-1), None
        from engine.kernels.lse_argmax import lse_argmax

        if self._counts.numel() < logits.shape[0]:
            self._counts = torch.zeros(logits.shape[0], dtype=torch.int32, device=self.device)
        return lse_argmax(logits, temps, self._counts)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, logit bias, then min_new_tokens masking: a new [B, V] float32 tensor, or
        `logits` itself (any dtype, left as it is) when no row has any of them."""
        if (batch.repetition_penalties is None and batch.output_pairs is None and batch.bias_pairs is None
                and batch.banned_pairs is None and batch.grammar_rows is None):  # fmt: skip
            return logits
        logits = logits.to(torch.float32, copy=True)
        batch_size, vocab_size = logits.shape
        if batch.repetition_penalties is not None and batch.seen_pairs is not None:
            # Seen tokens move toward "less likely": positive logits divided, negative multiplied.
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[batch.seen_pairs[0], batch.seen_pairs[1]] = True
            penalty = batch.repetition_penalties[:, None]
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if (
            batch.output_pairs is not None
            and batch.output_counts is not None
            and batch.frequency_penalties is not None
            and batch.presence_penalties is not None
        ):
            counts = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=logits.device)
            counts[batch.output_pairs[0], batch.output_pairs[1]] = batch.output_counts
            logits -= batch.frequency_penalties[:, None] * counts
            logits -= batch.presence_penalties[:, None] * (counts > 0).float()
        if batch.bias_pairs is not None and batch.bias_values is not None:
            logits[batch.bias_pairs[0], batch.bias_pairs[1]] += batch.bias_values  # pairs are unique
        # +-inf where a penalty or bias overflowed; never NaN: every factor and term is finite.
        logits.clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
        if batch.banned_pairs is not None:
            logits[batch.banned_pairs[0], batch.banned_pairs[1]] = float("-inf")
        if batch.grammar_rows is not None and batch.grammar_masks is not None:
            # The masks span the tokenizer, the first rows of the vocabulary: nothing past them is allowed.
            bits = torch.arange(32, dtype=torch.int32, device=logits.device)
            unpacked = ((batch.grammar_masks[:, :, None] >> bits) & 1).view(len(batch.grammar_rows), -1)
            n = min(unpacked.shape[1], vocab_size)
            allowed = torch.zeros(len(batch.grammar_rows), vocab_size, dtype=torch.bool, device=logits.device)
            allowed[:, :n] = unpacked[:, :n] != 0
            rows = logits[batch.grammar_rows]
            logits[batch.grammar_rows] = rows.masked_fill(~allowed, float("-inf"))
        return logits

    def _truncate(self, scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Top-k then top-p on temperature-scaled logits [B, V]: dropped tokens become -inf.
        Top-p keeps the smallest best-first prefix whose probability (renormalised after top-k)
        reaches top_p: token j stays iff the mass strictly before it is < top_p."""
        if not (batch.use_top_k or batch.use_top_p):
            return scaled
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V] each
        vocab_size = scaled.shape[-1]
        if batch.use_top_k:
            assert batch.top_ks is not None
            rank = torch.arange(vocab_size, device=scaled.device)[None, :]  # [1, V]
            k = torch.where(batch.top_ks > 0, batch.top_ks, vocab_size)[:, None]  # [B, 1]
            sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        if batch.use_top_p:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [B, V]
            cut = (mass_before >= batch.top_ps[:, None]) & (batch.top_ps[:, None] < 1.0)
            cut[:, 0] = False  # the best token always stays, whatever rounding does
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)

    def _exponential_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exp(1) noise [B, V]: seeded rows keyed by their step seed alone (one launch of
        kernels/seeded_noise.py, or a generator per row), the rest from the shared generator, which
        a step of seeded rows only (`--deterministic`'s every step) does not draw."""
        noise = torch.empty_like(probs)
        if batch.seed_rows is None or batch.seed_rows.shape[1] < probs.shape[0]:
            noise.exponential_(generator=self.generator)
        if batch.seed_rows is not None and self.seeded_kernel:
            from engine.kernels.seeded_noise import exponential_rows

            exponential_rows(noise, batch.seed_rows[0], batch.seed_rows[1])
        elif batch.seed_rows is not None:  # on a CPU (CUDA takes the kernel): the read waits for no device
            for row, seed in zip(*batch.seed_rows.tolist(), strict=True):
                self._row_generator.manual_seed(seed)
                noise[row].exponential_(generator=self._row_generator)
        # Exp(1) can round to 0; 0 / 0 would be NaN, which argmax would pick.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
