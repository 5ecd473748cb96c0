"""The LoRA adapters one model serves on one ingress replica (docs/lora.md).

Three sources, by name: `lora_modules` (the deploy file), the sub-folders of Ray Serve LLM's
`dynamic_lora_loading_path` (read when a request names one: a new sub-folder is served without
a restart), and those loaded through `/v1/load_lora_adapter` on this replica (when
actors/http/lora_updates.py allows it); `/v1/unload_lora_adapter` takes any of them away here.
A lookup by name reads one folder at most; only `/v1/models` lists the dynamic folder.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from actors.http.lora_updates import RuntimeLoRAUpdates
from actors.http.openai_protocol import OpenAIError
from cluster.lora.adapter import adapter_folder
from cluster.lora.registry import dynamic_adapter_folder

if TYPE_CHECKING:
    from cluster.config import EngineConfig


class AdapterCatalogue:
    """One model's adapters on this replica: name -> folder."""

    def __init__(self, config: EngineConfig, updates: RuntimeLoRAUpdates) -> None:
        self.config, self.updates = config, updates
        self.base = config.model_config.name
        lc = config.lora_config
        self.enabled = lc.enable_lora
        self.configured = {n: adapter_folder(p) for n, p in lc.lora_modules.items()} if self.enabled else {}
        self.dynamic_root = lc.dynamic_lora_loading_path if self.enabled else None
        self.loaded: dict[str, str] = {}  # through /v1/load_lora_adapter
        self.unloaded: set[str] = set()  # configured or dynamic ones taken away

    def folder(self, name: str) -> str | None:
        """The folder of adapter `name`, or None if this model serves no such adapter."""
        if not self.enabled or name in self.unloaded:
            return None
        return self.loaded.get(name) or self.configured.get(name) or dynamic_adapter_folder(self.dynamic_root, name)

    def all(self) -> dict[str, str]:
        """Every adapter served, by name -> folder (the dynamic folder listed)."""
        found = dict(self.configured)
        root = Path(self.dynamic_root).expanduser() if self.dynamic_root else None
        if root is not None and root.is_dir():
            for d in sorted(root.iterdir()):
                if (f := dynamic_adapter_folder(str(root), d.name)) is not None:
                    found[d.name] = f
        found.update(self.loaded)
        return {name: path for name, path in found.items() if name not in self.unloaded}

    def cards(self, created: int, only: str | None = None, name: str | None = None) -> list[dict]:
        """vLLM's `/v1/models` entries of the adapters: the folder as `root`, the base as `parent`."""
        adapters = self.all() if only is None else {only: self.folder(only)}
        return [{"id": name or adapter, "object": "model", "created": created, "owned_by": "llm-cluster",
                 "root": path, "parent": self.base, "max_model_len": self.config.model_config.max_model_len}
                for adapter, path in adapters.items() if path is not None]

    def load(self, name: str, path: str) -> str:
        """vLLM's /v1/load_lora_adapter: check the folder (blocking: run it in a thread), then
        serve it as `name`. OpenAIError 404 when runtime loading is off for this model; 400 when
        the folder is not under `allowed_local_lora_paths` (nothing of it is read then), when
        `name` is already served, or when the folder cannot be served."""
        from cluster.lora.adapter import LoRAAdapterError, read_adapter

        folder = self.updates.folder(path, self.base)  # before anything touches the path
        if self.folder(name) is not None:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            read_adapter(name, folder, self.config.model_config.hf_config, self.config.lora_config.max_lora_rank)
        except LoRAAdapterError as exc:
            raise OpenAIError(400, str(exc), "lora_path") from exc
        self.loaded[name] = adapter_folder(folder)
        self.unloaded.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """vLLM's /v1/unload_lora_adapter: stop serving `name` (404 if it is not served, or if
        runtime loading is off for this model)."""
        self.updates.check_enabled(self.base)
        if self.folder(name) is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        if self.loaded.pop(name, None) is None:
            self.unloaded.add(name)
        return f"Success: LoRA adapter '{name}' removed successfully."
