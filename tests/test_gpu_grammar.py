"""Grammar-constrained decoding on a GPU (`pytest -m gpu`): decode steps replayed from CUDA graphs
with constrained rows beside free ones. Every constrained sample matches its schema; the free
rows' greedy tokens are the ones they get alone (the mask touches only its own rows)."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch
from test_grammar import SCHEMA, _matches

from engine import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(find_spec("xgrammar") is None, reason="needs xgrammar, which this install lacks"),
]


def test_constrained_rows_in_graph_steps(qwen3_dir: str) -> None:
    free = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    constrained = [SamplingParams(max_new_tokens=256, temperature=1.0, seed=i, json_schema=json.dumps(SCHEMA))
                   for i in range(8)]  # fmt: skip
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with Engine(model=qwen3_dir, device="cuda", dtype="bfloat16", max_model_len=512, cuda_graph_max_bs=16) as llm:
        assert llm.info["cuda_graph_batch_sizes"]
        alone = [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=free)]
        outs = llm.generate(input_ids=prompts + [[1, 2, 3]] * 8, sampling_params=[free, free, *constrained])
        assert [o.output_ids for o in outs[:2]] == alone
        for o in outs[2:]:
            assert o.finish_reason == "stop" and _matches(json.loads(o.text, strict=False)), o.text
