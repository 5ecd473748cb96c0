"""The models one ingress serves: per model its config, tokenizer, entry checks, engine
streams and metrics, and the lookup of a request's `model` among them.

The app builder (actors/app.py) hands the ingress one `ModelSpec` per model (its engine
deployment and finalized config); each ingress replica turns it into a `ServedModel`. A request
names its model in the body; `ModelTable.pick` finds it or answers OpenAI's 404
`model_not_found`, so a request only ever reaches its own model's engine deployment.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.http.lora_updates import RuntimeLoRAUpdates, disabled_error
from actors.http.openai_protocol import OpenAIError
from actors.http.prompt import PromptState
from actors.http.streams import EngineStreams
from actors.metrics import RequestMetrics
from cluster.lora.adapter import LoRARequest, adapter_folder
from cluster.lora.registry import dynamic_adapter_folder
from cluster.messages import EngineRequest
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import content_chars

if TYPE_CHECKING:
    from cluster.config import EngineConfig


@dataclass
class ModelSpec:
    """What the ingress needs of one model, from the app builder."""

    engine: Any  # the model's engine deployment (a DeploymentHandle in the replica)
    config: EngineConfig  # finalized; `model_config.name` is the id clients send as `model`
    tool_call_parser: str | None = "hermes"  # reads tool_choice="auto" answers (actors/http/tool_parser.py)
    stream_interval: int = 1  # tokens per SSE chunk after the first
    # /v1/load_lora_adapter and /v1/unload_lora_adapter: on or off, and from which folders
    # (resolved from the deploy file by EngineArgs.runtime_lora_updates: no default here).
    lora_updates: RuntimeLoRAUpdates = field(kw_only=True)


class ServedModel:
    """One model in an ingress replica: everything between a parsed body and its engine."""

    def __init__(self, spec: ModelSpec) -> None:
        from cluster.engine.input_processor import InputProcessor

        self.engine, self.config, self.tool_call_parser = spec.engine, spec.config, spec.tool_call_parser
        self.name = spec.config.model_config.name
        self.tokenizer = spec.config.model_config.get_tokenizer()
        self.inputs = InputProcessor(spec.config)
        self.metrics = RequestMetrics(self.name)
        self.streams = EngineStreams(spec.engine, self.tokenizer, self.metrics, spec.stream_interval)
        self.lora: LoRARequest | None = None  # set on the per-request view of an adapter (`for_adapter`)
        self.base_name = self.name
        # /v1/load_lora_adapter and /v1/unload_lora_adapter on this ingress replica (when
        # lora_updates allows them): adapters added (name -> folder) and configured ones taken away.
        self.lora_updates = spec.lora_updates
        self.loaded_adapters: dict[str, str] = {}
        self.unloaded_adapters: set[str] = set()

    def card(self, created: int) -> dict:
        """The model's entry in `/v1/models` (an adapter's, on an adapter's view)."""
        mc = self.config.model_config
        if self.lora is not None:
            return self.adapter_cards(created, only=self.lora.lora_name, name=self.name)[0]
        return {"id": self.name, "object": "model", "created": created, "owned_by": "llm-cluster",
                "root": mc.model, "max_model_len": mc.max_model_len}

    # ---- LoRA adapters (docs/lora.md) ---------------------------------------------------------
    def adapters(self) -> dict[str, str]:
        """The adapters this model serves by name -> folder: `lora_modules`, those loaded through
        the API, and the sub-folders of `dynamic_lora_loading_path`."""
        lc = self.config.lora_config
        if not lc.enable_lora:
            return {}
        found = {name: adapter_folder(path) for name, path in lc.lora_modules.items()}
        if lc.dynamic_lora_loading_path:
            root = Path(lc.dynamic_lora_loading_path).expanduser()
            names = sorted(d.name for d in root.iterdir()) if root.is_dir() else []
            found.update({n: f for n in names if (f := dynamic_adapter_folder(str(root), n)) is not None})
        found.update(self.loaded_adapters)
        return {name: path for name, path in found.items() if name not in self.unloaded_adapters}

    def adapter_cards(self, created: int, only: str | None = None, name: str | None = None) -> list[dict]:
        """vLLM's `/v1/models` entries of the adapters: the folder as `root`, the base as `parent`."""
        return [{"id": name or adapter, "object": "model", "created": created, "owned_by": "llm-cluster",
                 "root": path, "parent": self.base_name, "max_model_len": self.config.model_config.max_model_len}
                for adapter, path in self.adapters().items() if only in (None, adapter)]

    def load_adapter(self, name: str, path: str) -> str:
        """vLLM's /v1/load_lora_adapter: check the folder (blocking: run it in a thread), then
        serve it as `name`. OpenAIError 404 when runtime loading is off for this model; 400 when
        the folder is not under `allowed_local_lora_paths` (nothing of it is read then), when
        `name` is already served, or when the folder cannot be served."""
        from cluster.lora.adapter import LoRAAdapterError, read_adapter

        folder = self.lora_updates.folder(path, self.base_name)  # before anything touches the path
        if name in self.adapters():
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            read_adapter(name, folder, self.config.model_config.hf_config, self.config.lora_config.max_lora_rank)
        except LoRAAdapterError as exc:
            raise OpenAIError(400, str(exc), "lora_path") from exc
        self.loaded_adapters[name] = adapter_folder(folder)
        self.unloaded_adapters.discard(name)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_adapter(self, name: str) -> str:
        """vLLM's /v1/unload_lora_adapter: stop serving `name` (404 if it is not served, or if
        runtime loading is off for this model)."""
        self.lora_updates.check_enabled(self.base_name)
        if name not in self.adapters():
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        if self.loaded_adapters.pop(name, None) is None:
            self.unloaded_adapters.add(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def for_adapter(self, adapter: str, requested: str) -> "ServedModel | None":
        """This model as a request for `adapter` sees it (named `requested` in its responses);
        None when this model has no such adapter."""
        path = self.adapters().get(adapter)
        if path is None:
            return None
        view = copy.copy(self)  # shares the engine, tokenizer, streams and adapter tables
        view.name = requested
        # The folder travels with the request: the router keys its prefix blocks by it.
        view.lora = LoRARequest(adapter, lora_path=path)
        return view

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.check_text(len(text), "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_text(self, num_chars: int, field: str) -> None:
        try:  # before tokenizing: a multi-megabyte prompt would take seconds
            self.inputs.check_text(num_chars, field)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), field) from exc

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> list[int]:
        """The conversation through the model's chat template, tokenized."""
        reserved = sorted({"tokenize", "add_generation_prompt", "conversation", "messages"} & set(kwargs))
        if reserved:
            raise OpenAIError(400, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        self.check_text(content_chars(messages), "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, **kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "messages") from exc

    def prepare(self, rid: str, text: str | None, ids: list[int], params: SamplingParams,
                priority: int, arrival: float) -> PromptState:
        """One prompt through the engine's entry checks (InputProcessor.process): 400 if refused."""
        try:
            checked = self.inputs.process(EngineRequest(rid, ids, params, priority=priority))
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc
        return PromptState(rid, text, ids, checked.sampling_params, arrival=arrival, lora_request=self.lora)


def check_unique_names(names: list[str]) -> None:
    """ValueError unless every served model name is different (clients pick a model by name)."""
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be unique in an app, got {names}")


class ModelTable:
    """The served models by id, in the order the app lists them; the first is the default for a
    request that names none (as vLLM does)."""

    def __init__(self, models: list[ServedModel]) -> None:
        if not models:
            raise ValueError("an ingress needs at least one model")
        check_unique_names([m.name for m in models])
        self.by_name = {m.name: m for m in models}

    def __iter__(self):
        return iter(self.by_name.values())

    def lora_model(self, name: str | None) -> ServedModel:
        """The model /v1/load_lora_adapter and /v1/unload_lora_adapter act on: `name`, else the
        first that allows loading adapters at runtime. 404 where none allows it (as vLLM, which
        has no such routes then), or where `name` does not."""
        if not any(m.lora_updates.enabled for m in self):
            raise disabled_error()
        if name:
            model = self.get(name)
            model.lora_updates.check_enabled(model.base_name)
            return model
        return next(m for m in self if m.lora_updates.enabled)

    def pick(self, name: str | None) -> ServedModel:
        """The model a request body names (None or "": the first)."""
        return self.get(name) if name else next(iter(self.by_name.values()))

    def get(self, name: str) -> ServedModel:
        """The model called `name`, or an adapter: `<model>:<adapter>` (Ray Serve LLM's form) or
        `<adapter>` (vLLM's); OpenAI's 404 `model_not_found` if there is none."""
        model = self.by_name.get(name)
        if model is not None:
            return model
        base, _, adapter = name.rpartition(":")
        candidates = [self.by_name[base]] if base in self.by_name else []
        candidates += [m for m in self if m not in candidates]
        for m in candidates:
            view = m.for_adapter(adapter if m.name == base else name, name)
            if view is not None:
                return view
        served = ", ".join(f"`{n}`" for n in self.by_name)
        raise OpenAIError(404, f"The model `{name}` does not exist; this server serves {served} "
                               "(and their adapters, listed by /v1/models).", "model", code="model_not_found")
