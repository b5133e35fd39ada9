"""Configuration, the shared vocabulary of every process (server, engine, tensor-parallel
workers): what the user asks for and what the checkpoint says. Both are frozen.

- `engine_config.py`: `EngineConfig` (every flag of `siesta serve`) and `context_length`.
- `model_config.py`: `ModelConfig` (a checkpoint's config.json, normalised), `RopeScaling`,
  `ConfigError`.
"""

from engine.config.engine_config import EngineConfig, context_length
from engine.config.model_config import (
    SUPPORTED_ROPE_SCALING,
    ConfigError,
    ModelConfig,
    RopeScaling,
    dtype_name,
)

__all__ = ["SUPPORTED_ROPE_SCALING", "ConfigError", "EngineConfig", "ModelConfig", "RopeScaling", "context_length", "dtype_name"]
