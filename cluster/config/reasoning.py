"""Reasoning models: the strings around their thinking (`reasoning_config`), vLLM's
`reasoning_parser` names for them, and their token ids."""
from __future__ import annotations

from collections.abc import Callable

_KEYS = ("reasoning_start_str", "reasoning_end_str")
# vLLM's `reasoning_parser` names for models that think in <think>...</think> blocks.
REASONING_PARSERS = {name: {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
                     for name in ("qwen3", "deepseek_r1")}


def reasoning_parser_config(name: str) -> dict[str, str]:
    """The reasoning_config a vLLM `reasoning_parser` name stands for."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return dict(REASONING_PARSERS[name])


def check_reasoning_config(reasoning_config: dict[str, str] | None) -> None:
    if reasoning_config is None:
        return
    if not isinstance(reasoning_config, dict):
        raise ValueError(f"reasoning_config must be a dict with {_KEYS}, got {reasoning_config!r}")
    for key in _KEYS:
        value = reasoning_config.get(key)
        if not isinstance(value, str) or not value:
            raise ValueError(f"reasoning_config.{key} must be a non-empty string, got {value!r}")
    extra = set(reasoning_config) - set(_KEYS)
    if extra:
        raise ValueError(f"reasoning_config has unknown keys {sorted(extra)}; expected {_KEYS}")


def reasoning_token_ids(reasoning_config: dict[str, str] | None,
                        encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]] | None:
    """The (start, end) token id sequences; `encode` tokenizes without special tokens added,
    e.g. `lambda s: hf_tokenizer.encode(s, add_special_tokens=False)`."""
    if reasoning_config is None:
        return None
    check_reasoning_config(reasoning_config)
    start, end = (list(encode(reasoning_config[k])) for k in _KEYS)
    for key, ids in zip(_KEYS, (start, end)):
        if not ids:
            raise ValueError(f"reasoning_config.{key}={reasoning_config[key]!r} tokenizes to nothing")
    return start, end
