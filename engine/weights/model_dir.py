"""Where `--model` (and `--tokenizer`) point: a local checkpoint directory, or a Hugging Face repo
id resolved through `huggingface_hub`, as vLLM and SGLang take one. It runs in the process that
starts the engine, before the tokenizer or the engine process, and imports neither torch nor
transformers.

Rules:
- A name that exists on disk, or that cannot be a repo id (absolute, `~`, `..`, more than one `/`,
  a space), is a local directory. Anything else (`name`, `org/name`) is a repo id.
- A repo id resolves with `snapshot_download`: the cache under `HF_HOME` (or `HF_HUB_CACHE`)
  first when `HF_HUB_OFFLINE=1`, which reads nothing but the cache; online, the Hub says which
  revision `main` is and only missing files download (config, tokenizer and safetensors files).
- A model directory serves when it holds `config.json` and safetensors weights (`model.safetensors`,
  its index, or any `*.safetensors`); a tokenizer directory when it exists.
- Every failure is one `ModelNotFound` line naming the path or repo id and what is missing.
"""

from __future__ import annotations

import os
import re

from engine.config import ConfigError, EngineConfig

# What a repo id's download fetches: config, generation config, tokenizer files, safetensors.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_TRUE = ("1", "true", "yes", "on")
# A Hub repo id (huggingface_hub's rule): `name` or `org/name`, each of letters, digits, `-`, `_`
# and `.`, neither starting nor ending with `-` or `.`, with no `--` or `..`.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"^{_PART}(?:/{_PART})?$")


class ModelNotFound(ConfigError):
    """`--model` or `--tokenizer` names nothing Siesta can load; the message is one line."""


def resolve_config(config: EngineConfig) -> EngineConfig:
    """`config` with `model` (and `tokenizer`, when given) as local directories (with
    `load_format` dummy, a model directory needs its config.json only)."""
    model = resolve_model_dir(config.model, weights=config.load_format != "dummy")
    tokenizer = resolve_tokenizer_dir(config.tokenizer) if config.tokenizer else None
    if (model, tokenizer) == (config.model, config.tokenizer):
        return config
    return config.replace(model=model, tokenizer=tokenizer)


def resolve_model_dir(name: str, weights: bool = True) -> str:
    """The checkpoint directory `name` names: itself, or a repo id's snapshot in the Hub cache."""
    path = name if is_local(name) else _snapshot(name, "model")
    check_model_dir(path, name, weights)
    return path


def resolve_tokenizer_dir(name: str) -> str:
    if is_local(name):
        if not os.path.isdir(os.path.expanduser(name)):
            raise ModelNotFound(f"tokenizer directory {name!r} does not exist")
        return os.path.expanduser(name)
    return _snapshot(name, "tokenizer")


def check_model_dir(path: str, name: str | None = None, weights: bool = True) -> None:
    """Raise `ModelNotFound` unless `path` holds config.json and (`weights`) safetensors weights.
    `name`: what the user gave, when it was a repo id (the message names both)."""
    shown = repr(path) if name in (None, path) else f"{path!r} (the snapshot of {name!r})"
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelNotFound(f"model directory {shown} does not exist")
    if not os.path.isdir(path):
        raise ModelNotFound(f"model path {shown} is a file, not a checkpoint directory")
    files = os.listdir(path)
    if "config.json" not in files:
        raise ModelNotFound(f"model directory {shown} has no config.json: is it a Hugging Face checkpoint?")
    if weights and not any(f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in files):
        other = sorted(f for f in files if f.endswith((".bin", ".pt", ".pth", ".gguf")))
        found = f" (found {', '.join(other[:3])}: Siesta loads safetensors only)" if other else ""
        raise ModelNotFound(f"model directory {shown} has config.json but no *.safetensors weights{found}")


def is_local(name: str) -> bool:
    """Whether `name` is a local path rather than a Hub repo id."""
    if os.path.exists(os.path.expanduser(name)):
        return True
    return not _REPO_ID.match(name) or "--" in name or ".." in name


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE says to read only the cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def _snapshot(repo_id: str, what: str) -> str:
    """The local snapshot of Hub repo `repo_id`; one-line `ModelNotFound` when there is none."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = hub_offline()
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline)
    except HFValidationError:
        raise ModelNotFound(f"{what} {repo_id!r} is neither a local directory nor a Hugging Face repo id") from None
    except Exception as e:  # the Hub's errors: not cached, not found, gated, no network
        if offline:
            where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
            raise ModelNotFound(
                f"{what} {repo_id!r} is not a local directory and not in {where}; HF_HUB_OFFLINE=1 reads only "
                "the cache: download it once online, or give a checkpoint directory") from None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFound(
            f"{what} {repo_id!r} is not a local directory, and the Hugging Face Hub did not give it "
            f"({type(e).__name__}: {reason}); cache: {constants.HF_HUB_CACHE}") from None
