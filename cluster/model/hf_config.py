"""The model's transformers config as plain values (`HFConfig`): what a resolved engine config
carries to every process of a served model."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any


class HFConfig(SimpleNamespace):
    """A transformers config as plain attributes: every field its `to_dict()` writes (a nested
    config as an HFConfig), its `attribute_map` aliases, and `rope_scaling` / `torch_dtype`
    under their old names. Every process of a served model unpickles the resolved config;
    unpickling a transformers config imports its model package (torch.distributed.tensor,
    sympy), this does not."""

    @classmethod
    def of(cls, config: Any) -> HFConfig:
        values = {key: getattr(config, key) for key in config.to_dict() if hasattr(config, key)}
        values = {k: cls.of(v) if hasattr(v, "to_dict") and hasattr(v, "model_type") else v
                  for k, v in values.items()}
        for alias, name in getattr(type(config), "attribute_map", {}).items():
            values.setdefault(alias, getattr(config, name, None))
        values.setdefault("rope_scaling", getattr(config, "rope_scaling", None))
        values.setdefault("torch_dtype", values.get("dtype"))
        return cls(**values)

    def to_transformers(self) -> Any:
        """The transformers config these values make (for transformers' own model code)."""
        from transformers import AutoConfig

        values = {k: v.to_transformers() if isinstance(v, HFConfig) else v for k, v in vars(self).items()}
        return AutoConfig.for_model(values.pop("model_type"), **values)

    def to_json(self) -> str:
        """These values as JSON that `from_json` reads back equal (dtypes, tuples, nested
        configs and dicts with non-string keys tagged). TypeError for a value of another type."""
        return json.dumps(_encode(self))

    @classmethod
    def from_json(cls, text: str) -> HFConfig:
        return json.loads(text, object_hook=_decode)


def _encode(value: Any) -> Any:
    if isinstance(value, HFConfig):
        return {"__hf_config__": {k: _encode(v) for k, v in vars(value).items()}}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_encode(v) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).removeprefix("torch.")}
    raise TypeError(f"an HF config value of type {type(value).__name__} has no JSON form: {value!r}")


def _decode(obj: dict) -> Any:
    if "__hf_config__" in obj:
        return HFConfig(**obj["__hf_config__"])
    if "__items__" in obj:
        return dict(obj["__items__"])  # a tuple key is a tuple again already
    if "__tuple__" in obj:
        return tuple(obj["__tuple__"])
    if "__dtype__" in obj:
        import torch

        return getattr(torch, obj["__dtype__"])
    return obj
