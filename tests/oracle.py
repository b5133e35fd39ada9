"""The correctness oracle: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_named_parameters(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """A trainer's full fp32 tensors of `model_dir`, as transformers names them (what RL
    frameworks push in weight updates)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return [(n, p.detach().contiguous()) for n, p in model.named_parameters()]


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' own `generate`, one prompt at a time (no padding), EOS never stops it."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return greedy_of(model, prompts, n)


@torch.no_grad()
def greedy_of(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    """`hf_greedy` for a model already loaded (on any device, in any dtype)."""
    device = next(model.parameters()).device
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
        outs.append(gen[0, len(p):].tolist())
    return outs


def greedy_before_after(old_dir: str, new_dir: str, prompts: list[list[int]], n: int) -> dict[str, list[list[int]]]:
    """`hf_greedy` of the prompts on a checkpoint ("old") and on the one a weight update loads ("new")."""
    return {"old": hf_greedy(old_dir, prompts, n), "new": hf_greedy(new_dir, prompts, n)}
