"""Finding and instantiating processors: built-ins, `config.logits_processors` entries
(FQCN strings or classes) and installed packages' entry points.

A package registers processors in its pyproject:

    [project.entry-points."llm_cluster.logits_processors"]
    my_proc = "my_pkg.procs:MyLogitsProcessor"
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import torch

from cluster.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from cluster.sample.logits_processor.interface import LogitsProcessor
from cluster.sample.logits_processor.state import LogitsProcessors
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.config import EngineConfig

ENTRY_POINT_GROUP = "llm_cluster.logits_processors"


def _check_class(obj: Any, name: str) -> type[LogitsProcessor]:
    if not inspect.isclass(obj):
        raise ValueError(f"logits_processors: {name} is not a class (got {type(obj).__name__})")
    if not issubclass(obj, LogitsProcessor):
        raise ValueError(f"logits_processors: {name} is not a subclass of "
                         "cluster.sample.logits_processor.LogitsProcessor")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise ValueError(f"logits_processors: {name} is abstract (does not implement {missing})")
    return obj


def _import_fqcn(fqcn: str) -> Any:
    """'pkg.mod:Class' (or 'pkg.mod:Outer.Inner') or 'pkg.mod.Class' -> the object."""
    if ":" in fqcn:
        splits = [tuple(fqcn.split(":", 1))]
    else:  # no explicit split: try the longest importable module prefix first
        parts = fqcn.split(".")
        splits = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    if not splits or not all(splits[0]):
        raise ValueError(f"logits_processors: {fqcn!r} is not a fully qualified class name "
                         "('pkg.module:Class' or 'pkg.module.Class')")
    error: Exception | None = None
    for module_name, qualname in splits:
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if not (module_name == missing or module_name.startswith(missing + ".")):
                raise ValueError(f"logits_processors: importing {module_name!r} for {fqcn!r} "
                                 f"failed: {e}") from e
            error = error or e
            continue
        except Exception as e:  # noqa: BLE001 - the module exists but fails to import
            raise ValueError(f"logits_processors: importing {module_name!r} for {fqcn!r} "
                             f"failed: {e}") from e
        try:
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(f"logits_processors: {fqcn!r}: module {module_name!r} has no "
                             f"attribute {qualname!r}") from None
        return obj
    raise ValueError(f"logits_processors: cannot import {fqcn!r}: {error}") from error


def _entry_point_classes() -> list[type[LogitsProcessor]]:
    classes = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        name = f"entry point {ep.name!r} ({ep.value})"
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - any import failure is a bad plugin
            raise ValueError(f"logits_processors: cannot load {name}: {e}") from e
        classes.append(_check_class(obj, name))
    return classes


def load_custom_logitsprocs(config: "EngineConfig") -> list[type[LogitsProcessor]]:
    """Custom processor classes: installed entry points, then `config.logits_processors`
    in order (each class once). With speculative decoding configured, each must declare
    support for it (ValueError otherwise)."""
    classes = _entry_point_classes()
    for spec in config.logits_processors or []:
        if isinstance(spec, str):
            classes.append(_check_class(_import_fqcn(spec), repr(spec)))
        else:
            classes.append(_check_class(spec, repr(spec)))
    classes = list(dict.fromkeys(classes))
    check_spec_decode_support(config, classes)
    return classes


def check_spec_decode_support(config: "EngineConfig", classes: Iterable[type[LogitsProcessor]]) -> None:
    """vLLM's rule: with speculative decoding on, every processor must opt in with
    `supports_spec_decode() -> True` and implement `apply_with_spec_decode`."""
    if getattr(config, "speculative_config", None) is None:
        return
    for cls in classes:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if not cls.supports_spec_decode():
            raise ValueError(
                f"logits_processors: {name} does not support speculative decoding, which "
                "speculative_config turns on. Start without speculative_config, or make the "
                "processor exact at every draft position and declare it: supports_spec_decode() "
                "returning True plus apply_with_spec_decode(logits, spec) (docs/logits_processors.md)")
        if cls.apply_with_spec_decode is LogitsProcessor.apply_with_spec_decode:
            raise ValueError(f"logits_processors: {name} declares supports_spec_decode() but does not "
                             "implement apply_with_spec_decode(logits, spec)")


def validate_request_params(classes: Iterable[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Run every custom processor's `validate_params`; a ValueError rejects the request."""
    for cls in classes:
        cls.validate_params(params)


def build_logitsprocs(config: "EngineConfig", device: torch.device | str, is_pin_memory: bool,
                      custom: Sequence[type[LogitsProcessor]] | None = None) -> LogitsProcessors:
    """Built-ins (min-p, logit bias, min-tokens, and the thinking budget when the config has
    reasoning token ids) plus the custom ones (default: those the config names)."""
    from cluster.sample.thinking_budget import ThinkingBudget

    device = torch.device(device)
    procs: list[LogitsProcessor] = [
        MinPLogitsProcessor(config, device, is_pin_memory),
        LogitBiasLogitsProcessor(config, device, is_pin_memory),
        MinTokensLogitsProcessor(config, device, is_pin_memory),
    ]
    if config.reasoning_token_ids:
        procs.append(ThinkingBudget(*config.reasoning_token_ids, device=device))
    if custom is None:
        custom = load_custom_logitsprocs(config)
    else:
        check_spec_decode_support(config, custom)
    for cls in custom:
        procs.append(cls(config, device, is_pin_memory))
    return LogitsProcessors(procs)
