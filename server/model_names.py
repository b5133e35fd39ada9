"""`ModelNames`: which `model` the OpenAI routes serve, as vLLM decides it.

Rules:
- The served names are `--served-model-name` (one or more), else `--model` as given (a path or
  a repo id). /v1/models lists them; replies carry the first.
- A request may also name the checkpoint directory the engine loaded (its path as resolved, or
  its real path): RL clients send the path they trained from.
- A missing, null or empty `model` means the first served name (vLLM's default).
- Any other name is a 404 with OpenAI's error body, code `model_not_found`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


class ModelNotServed(LookupError):
    """A request named a model this server does not serve (HTTP 404, `model_not_found`)."""

    status = 404
    code = "model_not_found"
    param = "model"


@dataclass(frozen=True)
class ModelNames:
    served: tuple[str, ...]
    accepted: frozenset[str]

    @classmethod
    def of(cls, served: Sequence[str], model_dir: str) -> ModelNames:
        """`served`: --served-model-name's names (empty: `model_dir`'s); `model_dir`: the
        checkpoint directory the engine loaded."""
        names = tuple(dict.fromkeys(served)) or (model_dir,)
        paths = {model_dir, os.path.abspath(model_dir), os.path.realpath(model_dir)}
        return cls(names, frozenset(names) | paths)

    def check(self, model: str | None) -> None:
        """Raise `ModelNotServed` unless `model` is missing or one this server answers to."""
        if not model or model in self.accepted:
            return
        served = ", ".join(repr(n) for n in self.served)
        raise ModelNotServed(f"the model {model!r} does not exist: this server serves {served} (GET /v1/models)")
