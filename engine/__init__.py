"""Siesta's inference engine. `Engine` is the blocking Python API over the engine process.

Names are imported lazily so that pure-Python parts (request, scheduler, kv_cache) import without
torch, and the server process imports only what it uses.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine.client.sync_client",
    "EngineDeadError": "engine.errors",
    "MemoryNotAvailable": "engine.client.sync_client",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "GenerationOutput": "engine.client.output",
    "InvalidRequest": "engine.errors",
    "ModelNotFound": "engine.weights.model_dir",
    "SamplingParams": "engine.request",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
