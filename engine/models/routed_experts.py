"""`RoutedExperts`: the experts every MoE layer's router chose in a model's last forward, for RL
routing replay (SGLang's and verl's `return_routed_experts`).

Layout (SGLang's device buffer): `buffer` [max_tokens, num_layers, k] int32, row t of the last
forward's token t (its ragged batch order), column l of decoder layer l, each entry an expert
id in [0, num_experts), in the router's order (highest routing weight first). A dense layer's
column (Qwen3-MoE's mlp_only_layers) is never written and stays 0.

Rules:
- Allocated once at the largest token count of a step (the model runner: inside the `cuda_graph`
  region; zeroed again after each resume of it) and written in place by every forward, so a CUDA graph records the writes and a replay
  makes them: the ids read after a step are the ones its forward used, graphs included.
- Each forward overwrites rows [0, T) of every sparse layer; rows past T are the previous steps'
  (a padded graph's extra rows hold the padding's choices). Read a step's rows before the next
  forward runs.
- With tensor parallelism every rank routes the same tokens the same way; one rank's buffer is
  the step's.
"""

from __future__ import annotations

import torch


class RoutedExperts:
    def __init__(self, num_layers: int, top_k: int, max_tokens: int, device: torch.device | str | None = None) -> None:
        if max_tokens < 1 or top_k < 1:
            raise ValueError(f"routed experts need max_tokens >= 1 and top_k >= 1, got {max_tokens}, {top_k}")
        self.buffer = torch.zeros(max_tokens, num_layers, top_k, dtype=torch.int32, device=device)

    @property
    def max_tokens(self) -> int:
        return self.buffer.shape[0]

    def reset(self) -> None:
        """Zero the buffer (after its memory came back undefined: a dense layer's column is never
        written by a forward)."""
        self.buffer.zero_()

    def record(self, layer_id: int, ids: torch.Tensor) -> None:
        """Layer `layer_id`'s choices for the step's tokens: ids [T, k] (any integer dtype)."""
        if ids.shape[0] > self.max_tokens:
            raise ValueError(f"a step of {ids.shape[0]} tokens is over the {self.max_tokens} routed experts are kept for")
        self.buffer[: ids.shape[0], layer_id].copy_(ids)

    def last(self, num_tokens: int) -> torch.Tensor:
        """The last forward's choices for its first `num_tokens` tokens: [num_tokens, num_layers,
        k] int32, a view of the buffer (the next forward overwrites it)."""
        return self.buffer[:num_tokens]
