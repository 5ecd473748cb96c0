"""The engine options a deploy file may set, typed: one set for both forms of deploy file.

`build_app` (the short form) takes them at the top of its `args`; `build_openai_app` (Ray Serve
LLM's form) takes them in each model's `engine_kwargs`. `EngineArgs` is derived from the options
EngineConfig's sub-configs declare (cluster/config/, vLLM's names): each field's type, bounds,
allowed values and description come from that one declaration, so pydantic refuses a bad value
when the app is built, naming the field, with the same rule `EngineConfig.finalize` applies to
the offline `LLM`. Beside them: two options the ingress applies per model (`tool_call_parser`,
`stream_interval`, vLLM's serving options), two that say whether clients may load adapters
(`allow_runtime_lora_updating`, `allowed_local_lora_paths`: actors/http/lora_updates.py) and the
replica's `step_timeout_s`. `finalize` then checks what needs the model (context length, dtype),
and `runtime_lora_updates` what needs its LoRA settings.
"""
# No `from __future__ import annotations`: Serve and pydantic read these annotations as classes.
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from cluster.config import (CacheConfig, EngineConfig, LimitsConfig, LoRAConfig, ModelConfig, ParallelConfig,
                            SchedulerConfig)
from cluster.config.options import Bounds, options

if TYPE_CHECKING:
    from actors.http.lora_updates import RuntimeLoRAUpdates

# Where the deploy file's type is not the config's own (which also takes Python objects).
DEPLOY_TYPES = {"speculative_config": dict[str, Any], "lora_modules": dict[str, str] | list[Any],
                "logits_processors": list[str]}
CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, LimitsConfig, LoRAConfig, EngineConfig)


class _ServingArgs(BaseModel):
    """The options outside EngineConfig, and what both deploy forms do with the whole set."""

    model_config = ConfigDict(extra="forbid")

    # A step (or a collective between workers) that takes longer marks the copy failed: requests
    # with no token yet are retried on another copy, the rest end with an error, Serve replaces it.
    step_timeout_s: float | None = Field(default=None, gt=0)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (the ingress; docs/lora.md): off unless this
    # is true (not given: vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING where the app is built decides),
    # and then only for folders under allowed_local_lora_paths (required when on).
    allow_runtime_lora_updating: bool | None = None
    allowed_local_lora_paths: list[str] = []
    # vLLM's --tool-call-parser: reads tool calls out of tool_choice="auto" answers.
    tool_call_parser: str | None = "hermes"
    stream_interval: int = Field(default=1, ge=1)  # tokens per SSE chunk after the first (the ingress)

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        from actors.http.tool_parser import check_tool_call_parser

        return check_tool_call_parser(name)

    @field_validator("allowed_local_lora_paths", mode="before")
    @classmethod
    def _local_folders(cls, value: Any) -> Any:
        if value is None:
            return []
        paths = [value] if isinstance(value, str) else value  # one folder, as vLLM's allowed_local_media_path
        for path in paths if isinstance(paths, list) else ():
            if path == "":
                raise ValueError("an empty path is not a folder")
            if isinstance(path, str) and "://" in path:
                raise ValueError(f"{path!r}: only local or mounted folders are supported (no remote URIs)")
        return paths

    def runtime_lora_updates(self, enable_lora: bool) -> "RuntimeLoRAUpdates":
        """Whether clients may load and unload this model's adapters, and from which folders;
        `enable_lora` is the finalized config's. ValueError naming the option otherwise."""
        from actors.http.lora_updates import RuntimeLoRAUpdates

        return RuntimeLoRAUpdates.create(self.allow_runtime_lora_updating, self.allowed_local_lora_paths, enable_lora)

    def engine_options(self) -> dict[str, Any]:
        """The EngineConfig options given (None means: the preset's or the engine's default)."""
        return {name: getattr(self, name) for name in self._engine_fields() if getattr(self, name) is not None}

    @classmethod
    def _engine_fields(cls) -> tuple[str, ...]:
        return tuple(CONFIG_OPTIONS)


def _deploy_field(cls: type, name: str, bounds: Bounds) -> tuple[Any, Any]:
    """(type, pydantic Field) of one EngineConfig option in the deploy file: optional (None: not
    given), typed and bounded as the option is declared."""
    if bounds.boolean:
        kind = bool
    elif bounds.choices is not None:
        kind = Literal[bounds.choices]
    else:
        kind = DEPLOY_TYPES.get(name) or typing.get_type_hints(cls)[name]
    limits = {k: getattr(bounds, k) for k in ("ge", "gt", "le") if getattr(bounds, k) is not None}
    return kind | None, Field(default=None, description=bounds.doc or None, **limits)


CONFIG_OPTIONS = {name: _deploy_field(cls, name, bounds) for cls in CONFIG_CLASSES
                  for name, bounds in options(cls).items()}

# The engine options a deploy file may set: every option EngineConfig declares (its bounds and
# allowed values as declared there), plus the serving ones of _ServingArgs.
EngineArgs = create_model("EngineArgs", __base__=_ServingArgs, **CONFIG_OPTIONS)
EngineArgs.__doc__ = "The engine options of a deploy file (actors/engine_args.py)."
