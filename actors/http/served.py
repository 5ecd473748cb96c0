"""The models one ingress serves: per model its config, tokenizer, entry checks, engine
streams, metrics and adapters, and the lookup of a request's `model` among them.

The app builder (actors/app.py) hands the ingress one `ModelSpec` per model (its engine
deployment and finalized config); each ingress replica turns it into a `ServedModel`. A request
names its model in the body; `ModelTable.pick` finds it, as a `Target` (the model, the name
asked for, the adapter if any: actors/http/adapters.py), or answers OpenAI's 404
`model_not_found`, so a request only ever reaches its own model's engine deployment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.http.adapters import AdapterCatalogue
from actors.http.lora_updates import RuntimeLoRAUpdates, disabled_error
from actors.http.openai_protocol import OpenAIError
from actors.http.prompt import PromptState
from actors.http.streams import EngineStreams
from actors.metrics import RequestMetrics
from cluster.lora.adapter import LoRARequest
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
    """One model in an ingress replica: everything between a parsed body and its engine. Shared by
    every request for it; what differs per request (the name it asked for, the adapter) is its
    `Target`."""

    def __init__(self, spec: ModelSpec) -> None:
        from cluster.engine.input_processor import InputProcessor

        self.engine, self.config, self.tool_call_parser = spec.engine, spec.config, spec.tool_call_parser
        self.name = spec.config.model_config.name
        self.tokenizer = spec.config.model_config.get_tokenizer()
        self.inputs = InputProcessor(spec.config)
        self.metrics = RequestMetrics(self.name)
        self.streams = EngineStreams(spec.engine, self.tokenizer, self.metrics, spec.stream_interval)
        self.lora_updates = spec.lora_updates
        self.adapters = AdapterCatalogue(spec.config, spec.lora_updates)

    def card(self, created: int) -> dict:
        """The model's entry in `/v1/models`."""
        mc = self.config.model_config
        return {"id": self.name, "object": "model", "created": created, "owned_by": "llm-cluster",
                "root": mc.model, "max_model_len": mc.max_model_len}

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

    def prepare(self, rid: str, text: str | None, ids: list[int], params: SamplingParams, priority: int,
                arrival: float, lora: LoRARequest | None = None, task: str = "generate") -> PromptState:
        """One prompt through the engine's entry checks (InputProcessor.process): 400 if refused,
        or if the model is not served for `task` (an embedding model generates nothing)."""
        if self.config.model_config.task != task:
            raise OpenAIError(400, f"model `{self.name}` is served for {self.config.model_config.task!r} "
                                   f"(task: {self.config.model_config.task}); this endpoint needs task {task!r}",
                              "model")
        try:
            checked = self.inputs.process(EngineRequest(rid, ids, params, priority=priority))
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc
        return PromptState(rid, text, ids, checked.sampling_params, arrival=arrival, lora_request=lora)


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: a served model, under the name the request gave, and the
    adapter it runs under (None: the base model)."""

    model: ServedModel
    name: str  # echoed in the answer's `model`
    lora: LoRARequest | None = None

    def card(self, created: int) -> dict:
        if self.lora is None:
            return self.model.card(created)
        return self.model.adapters.cards(created, only=self.lora.lora_name, name=self.name)[0]


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
            model = self.get(name).model
            model.lora_updates.check_enabled(model.name)
            return model
        return next(m for m in self if m.lora_updates.enabled)

    def pick(self, name: str | None) -> Target:
        """The target a request body names (None or "": the first model)."""
        if not name:
            first = next(iter(self.by_name.values()))
            return Target(first, first.name)
        return self.get(name)

    def get(self, name: str) -> Target:
        """The model called `name`, or an adapter: `<model>:<adapter>` (Ray Serve LLM's form) or
        `<adapter>` (vLLM's); OpenAI's 404 `model_not_found` if there is none."""
        model = self.by_name.get(name)
        if model is not None:
            return Target(model, name)
        base, _, adapter = name.rpartition(":")
        candidates = [(self.by_name[base], adapter)] if base in self.by_name else []
        candidates += [(m, name) for m in self if m.name != base]
        for m, adapter_name in candidates:
            folder = m.adapters.folder(adapter_name)
            if folder is not None:
                # The folder travels with the request: the router keys its prefix blocks by it.
                return Target(m, name, LoRARequest(adapter_name, lora_path=folder))
        served = ", ".join(f"`{n}`" for n in self.by_name)
        raise OpenAIError(404, f"The model `{name}` does not exist; this server serves {served} "
                               "(and their adapters, listed by /v1/models).", "model", code="model_not_found")
