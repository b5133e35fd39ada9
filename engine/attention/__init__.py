"""Attention backends, by name, imported lazily so that a CPU install never imports Triton."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext

# name -> "module:Class"
_BACKENDS: dict[str, str] = {
    "sdpa": "engine.attention.sdpa:SdpaBackend",
    "sdpa_rows": "engine.attention.sdpa_rows:RowwiseSdpaBackend",  # --deterministic on a CPU
    "triton": "engine.attention.triton:TritonBackend",
}


def resolve_backend_name(name: str, device_type: str, deterministic: bool = False) -> str:
    """`auto` picks the fastest backend for the device: triton on CUDA once it exists, else sdpa.
    `deterministic` (`--deterministic`): the row-wise sdpa, on a CPU only (ConfigError else)."""
    from engine.config import ConfigError

    if deterministic:
        if device_type != "cpu" or name not in ("auto", "sdpa", "sdpa_rows"):
            raise ConfigError("--deterministic runs on a CPU with the sdpa attention backend: the batch-invariant "
                              f"CUDA kernels do not exist yet (device {device_type}, attention backend {name})")
        return "sdpa_rows"
    if name == "auto":
        return "triton" if device_type == "cuda" and "triton" in _BACKENDS else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: auto, {', '.join(_BACKENDS)}")
    return name


def get_backend_class(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "get_backend_class", "resolve_backend_name"]
