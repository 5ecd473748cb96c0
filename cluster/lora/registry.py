"""The adapters one engine can serve, by name, each read and checked once.

An adapter comes from `lora_modules` (read at start), from a request naming one with its folder
(`LoRARequest.lora_path`: the offline API, `/v1/load_lora_adapter`), or from
`<dynamic_lora_loading_path>/<name>/` on first use (Ray Serve LLM's multiplexing). `prepare`
reads and checks a folder (disk and every tensor's shape: tens of milliseconds): callers on an
event loop run it in a thread, so the step loop never waits for a disk. It is thread-safe, and
concurrent prepares of one name read it once. Up to `max_num_adapters_per_replica` adapters are
remembered; past that the least recently used one not in `lora_modules` is forgotten (read
again when next asked for).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

from cluster.config import EngineConfig
from cluster.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRARequest, adapter_folder, read_adapter


class LoRANotFoundError(ValueError):
    """No adapter by that name (HTTP 404 `model_not_found`)."""


class LoRARegistry:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.lora_config
        self.hf_config = config.model_config.hf_config
        self._lock = threading.Lock()
        self._known: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._reading: dict[str, Future] = {}
        self.load_seconds: dict[str, float] = {}  # the last read of each adapter
        for name, path in self.config.lora_modules.items():
            self.prepare(LoRARequest(name, lora_path=path))

    def names(self) -> list[str]:
        with self._lock:
            return list(self._known)

    def get(self, name: str) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._known.get(name)
            if adapter is not None:
                self._known.move_to_end(name)
            return adapter

    def prepare(self, request: LoRARequest) -> LoRAAdapter:
        """The checked adapter `request` names, reading it if needed. LoRANotFoundError when no
        folder is known for the name; LoRAAdapterError when the folder cannot be served."""
        name = request.lora_name
        with self._lock:
            known = self._known.get(name)
            path = None if request.lora_path is None else adapter_folder(request.lora_path)
            if known is not None and path in (None, known.path):
                self._known.move_to_end(name)
                return known
            future = self._reading.get(name)
            reader = future is None
            if reader:
                future = self._reading[name] = Future()
        if not reader:
            return future.result()
        try:
            adapter = self._read(name, request.lora_path)
        except BaseException as exc:
            with self._lock:
                del self._reading[name]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._reading[name]
            self._known[name] = adapter
            self._forget_extra()
        future.set_result(adapter)
        return adapter

    def remove(self, name: str) -> bool:
        """Forget an adapter (it is read again if asked for); False if it was not known."""
        with self._lock:
            return self._known.pop(name, None) is not None

    def _read(self, name: str, path: str | None) -> LoRAAdapter:
        if path is None:
            path = self.config.lora_modules.get(name) or self._dynamic_folder(name)
        start = time.perf_counter()
        adapter = read_adapter(name, path, self.hf_config, self.config.max_lora_rank)
        self.load_seconds[name] = time.perf_counter() - start
        return adapter

    def _dynamic_folder(self, name: str) -> str:
        folder = dynamic_adapter_folder(self.config.dynamic_lora_loading_path, name)
        if folder is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r}")
        return folder

    def _forget_extra(self) -> None:
        limit = max(self.config.max_num_adapters_per_replica, len(self.config.lora_modules))
        for name in list(self._known):
            if len(self._known) <= limit:
                break
            if name not in self.config.lora_modules:
                del self._known[name]


def dynamic_adapter_folder(root: str | None, name: str) -> str | None:
    """`<root>/<name>/` when that folder exists (Ray Serve LLM's dynamic_lora_loading_path)."""
    if root is None or "/" in name or name in (".", ".."):
        return None
    folder = Path(root).expanduser() / name
    return adapter_folder(folder) if folder.is_dir() else None


__all__ = ["LoRAAdapterError", "LoRANotFoundError", "LoRARegistry", "LoRARequest"]
