"""LoRA adapters: vLLM's options and Ray Serve LLM's `lora_config` keys."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config.options import Freezable, check_options, option


@dataclass
class LoRAConfig(Freezable):
    """LoRA adapters (docs/lora.md): vLLM's options, `enable_lora` turning them on, and Ray
    Serve LLM's `lora_config` keys. `lora_modules` (name -> PEFT folder; vLLM's list of
    "name=path" strings or {"name", "path"} dicts also work) are read at start; an adapter
    named in a request and found as `<dynamic_lora_loading_path>/<name>/` is read on first
    use. `max_loras` adapters sit in the batch's slots at once (least recently used idle ones
    make room); `max_num_adapters_per_replica` checked adapters are remembered per copy."""

    enable_lora: bool = option(False, boolean=True, doc="serve LoRA adapters beside the base model")
    max_loras: int = option(1, ge=1, doc="adapters in one batch at once")
    max_lora_rank: int = option(16, ge=1)
    lora_modules: Any = option(None, nullable=True, doc="{name: PEFT folder}, or vLLM's list of name=path")
    dynamic_lora_loading_path: str | None = option(None, nullable=True,
                                                   doc="a folder whose sub-folders are adapters, read on first use")
    max_num_adapters_per_replica: int = option(16, ge=1, doc="checked adapters remembered per copy")

    def validate(self) -> None:
        """Options checked, `lora_modules` normalized to {name: path}."""
        self.lora_modules = _lora_modules(self.lora_modules)
        if not self.enable_lora:
            given = [k for k in ("lora_modules", "dynamic_lora_loading_path") if getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)} needs enable_lora=true")
            return
        check_options(self)
        path = self.dynamic_lora_loading_path
        if path is not None and not Path(path).expanduser().is_dir():
            raise ValueError(f"dynamic_lora_loading_path {path!r} is not a directory")


def _lora_modules(value: Any) -> dict[str, str]:
    """vLLM's forms of lora_modules -> {name: path}."""
    if not value:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for entry in value:
            if isinstance(entry, str) and "=" in entry:
                items.append(tuple(entry.split("=", 1)))
            elif isinstance(entry, dict) and {"name", "path"} <= set(entry):
                items.append((entry["name"], entry["path"]))
            else:
                raise ValueError(f"lora_modules entries must be 'name=path' or {{'name': ..., 'path': ...}}, "
                                 f"got {entry!r}")
    else:
        raise ValueError(f"lora_modules must be a dict of name -> path or a list, got {value!r}")
    for name, path in items:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: name and path must be non-empty strings, got {name!r} -> {path!r}")
    return dict(items)
