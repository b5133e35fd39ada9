"""Attention backends, by name, imported lazily so that a CPU install never imports Triton."""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend, AttentionMetadata, ForwardContext

# name -> "module:Class"
_BACKENDS: dict[str, str] = {
    "sdpa": "engine.attention.sdpa:SdpaBackend",
    "sdpa_rows": "engine.attention.sdpa_rows:RowwiseSdpaBackend",  # --deterministic
    "triton": "engine.attention.triton:TritonBackend",
    "triton_fixed": "engine.attention.triton_fixed:FixedSplitBackend",  # --deterministic on CUDA
}
# What --deterministic accepts: backends whose reductions follow each row alone.
_ROW_INVARIANT = ("sdpa_rows", "triton_fixed")


def resolve_backend_name(name: str, device_type: str, deterministic: bool = False) -> str:
    """`auto` picks the fastest backend for the device: triton on CUDA once it exists, else sdpa.
    `deterministic` (`--deterministic`): the fixed-split Triton kernel on CUDA (`triton_fixed`),
    the row-wise sdpa elsewhere or when named (`sdpa_rows`, `sdpa`); ConfigError for any other name."""
    from engine.config import ConfigError

    if deterministic:
        if name not in ("auto", "sdpa", *_ROW_INVARIANT):
            raise ConfigError(f"--deterministic attends with a row-invariant backend ({', '.join(_ROW_INVARIANT)}): "
                              f"the attention backend {name!r} reduces in an order that follows the batch")
        if name == "auto":
            return "triton_fixed" if device_type == "cuda" else "sdpa_rows"
        return name if name in _ROW_INVARIANT else "sdpa_rows"
    if name == "auto":
        return "triton" if device_type == "cuda" and "triton" in _BACKENDS else "sdpa"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: auto, {', '.join(_BACKENDS)}")
    return name


def get_backend_class(name: str) -> type[AttentionBackend]:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "get_backend_class", "resolve_backend_name"]
