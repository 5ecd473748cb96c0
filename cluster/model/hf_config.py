"""The model's transformers config as plain values (`HFConfig`): what a resolved engine config
carries to every process of a served model."""
from __future__ import annotations

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
