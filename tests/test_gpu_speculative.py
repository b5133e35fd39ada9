"""Speculative decoding on CUDA (`pytest -m gpu`).

- tests/test_speculative.py's engine tests with the engine on the GPU (`device` auto): greedy
  tokens equal plain decoding's in float32, and with `--deterministic` seeded sampled tokens and
  logprobs equal plain decoding's bit for bit.
- tests/test_draft_model.py's engine tests on the GPU (a draft model: its Triton attention over
  its own cache on the target's blocks, its forwards replayed from its own decode graphs), and a
  bf16 model of Qwen3-0.6B's widths drafting for itself: nearly every draft stands, several
  tokens a step, a drafting step's catch-up of two rows a request replayed as verify rows, and
  each further draft (and a catch-up of one row a request) a replay of one row a request.
- A verify step is planned as decode rows (engine/runner/step_plan.py `_plan_verify`) and replays
  a verify graph, captured without the decode paths that store one row while another reads
  (ForwardContext.verify). On a model the decode paths serve (bf16, Qwen3-0.6B's widths), the
  logprobs a second rollout's verify steps report are, within bf16's rounding (median and
  largest difference), what a prefill re-scoring of the same text reports: no row read a stale
  K/V row of its step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_core
from test_draft_model import (  # noqa: F401  (collected here, on CUDA, with their fixtures)
    short_draft_dir,
    small_draft_dir,
    test_draft_weights_update_by_name_release_resume_and_target_updates,
    test_greedy_tokens_are_plain_decodings_whatever_the_draft,
    test_without_a_host_copy_a_release_loses_the_draft_not_the_engine,
)
from test_draft_model import (  # noqa: F401  (collected under a name of its own)
    test_deterministic_sampled_tokens_and_logprobs_are_bitwise_plain_decodings as test_draft_model_deterministic_bits,
)
from test_models import random_tokens
from test_speculative import (  # noqa: F401  (collected here, on CUDA)
    test_deterministic_sampled_tokens_and_logprobs_are_bitwise_plain_decodings,
    test_greedy_tokens_are_plain_decodings_and_a_second_rollout_accepts_the_first,
)

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.request import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_verify_steps_replay_their_graphs_and_score_what_a_prefill_scores(wide_qwen3_dir: str) -> None:
    core = EngineCore(EngineConfig(model=wide_qwen3_dir, device="cuda", dtype="bfloat16", max_model_len=512,
                                   max_num_seqs=8, speculative_algorithm="ngram"))  # fmt: skip
    graphs = core.runner.graphs
    assert graphs is not None and graphs.verify_graphs and core.runner.decode_paths
    replayed = []
    run = graphs.run

    def counted(plan):  # calls through
        replayed.append(plan.verify)
        return run(plan)

    graphs.run = counted
    prompt = random_tokens(40, seed=5) * 2
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, logprobs=True)
    first, _, _ = run_core(core, [("first", prompt, greedy)])["first"]
    ids, lps, _ = run_core(core, [("second", prompt, greedy)])["second"]  # the first rollout drafts it
    info = core.get_info()
    assert ids == first and info["spec_accepted_tokens"] >= 20, info
    assert sum(replayed) > 0, "no verify step replayed a verify graph"
    score = SamplingParams(max_new_tokens=0, temperature=1.0, logprobs=True, logprob_start_len=len(prompt))
    _, _, scored = run_core(core, [("scored", prompt + ids, score)])["scored"]
    assert len(scored) == len(ids) == len(lps)
    # bf16 decode rows against a bf16 prefill: 0.103 at worst (H200, 2026-11-29); a row that read a
    # stale K/V row of its step would be off by O(1) at most of the drafted positions.
    errors = sorted(abs(a - b) for a, b in zip(lps, scored, strict=True))
    assert errors[len(errors) // 2] < 0.05 and errors[-1] < 0.3, errors


def test_a_wide_bf16_model_as_its_own_draft_drafts_what_it_generates(wide_qwen3_dir: str) -> None:
    core = EngineCore(EngineConfig(model=wide_qwen3_dir, device="cuda", dtype="bfloat16", max_model_len=512,
                                   max_num_seqs=8, speculative_algorithm="draft",
                                   speculative_draft_model_path=wide_qwen3_dir))  # fmt: skip
    graphs = core.runner.draft.graphs
    assert graphs is not None and graphs.verify_graphs
    replays: list[tuple[int, bool]] = []
    replay = graphs.replay

    def counted(parts, temps, n, verify=False, long_kv=False):  # calls through
        replays.append((n, verify))
        return replay(parts, temps, n, verify, long_kv)

    graphs.replay = counted
    greedy = SamplingParams(max_new_tokens=96, temperature=0.0, ignore_eos=True)
    out = run_core(core, [(f"r{i}", random_tokens(40, seed=i), greedy) for i in range(3)])
    assert all(len(ids) == 96 for ids, _, _ in out.values())
    info = core.get_info()
    assert info["spec_accepted_tokens"] > 0.8 * info["spec_draft_tokens"] > 0, info
    assert core.num_steps < 0.5 * 96, core.num_steps
    # A proposal is one replay of catch-up rows (past the prompts, 1-2 a request; the prompts' own
    # catch-up, 120 tokens, runs eagerly: two rows a request, verify rows, once every draft
    # stood; one, a decode replay), then one of a row a request per further draft (k = 4: 3).
    catch_ups = [n for n, verify in replays if verify]
    assert sum(n <= 2 * 3 for n in catch_ups) >= 10, replays
    assert len(replays) - len(catch_ups) >= 3 * len(catch_ups), replays
