"""Who may load and unload LoRA adapters through the API, and from which folders (docs/lora.md,
"Loading adapters at runtime").

vLLM's `/v1/load_lora_adapter` makes the server read a folder a client names, and
`/v1/unload_lora_adapter` takes an adapter away from every client. Both are off unless the
operator turns them on for a model: the engine option `allow_runtime_lora_updating: true`, or,
when that option is not given, vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`1` / `true`, any case)
in the environment where the app is built. Turned on, a folder is read only when it lies under one
of `allowed_local_lora_paths` once its symlinks and `..` are resolved, and a model turned on
without any such folder is a build error: loading from anywhere on the disk is never allowed.

The app builder resolves the options per model (`RuntimeLoRAUpdates.create`, from
actors/engine_args.py); each ingress replica applies the result (actors/http/served.py).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from actors.http.openai_protocol import OpenAIError

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
OPTION = "allow_runtime_lora_updating"
ROOTS_OPTION = "allowed_local_lora_paths"


def env_allows_runtime_lora_updating(env: Mapping[str, str] | None = None) -> bool:
    """$VLLM_ALLOW_RUNTIME_LORA_UPDATING read as vLLM reads it: on for `1` or `true` (any case,
    surrounding spaces ignored), off otherwise and when unset."""
    value = (os.environ if env is None else env).get(RUNTIME_LORA_ENV, "0")
    return value.strip().lower() in ("1", "true")


@dataclass(frozen=True)
class RuntimeLoRAUpdates:
    """One model's runtime adapter loading: on or off, and the folders adapters may be loaded
    from (absolute, symlinks and `..` resolved when the app was built)."""

    enabled: bool
    roots: tuple[str, ...]

    @classmethod
    def create(cls, allow: bool | None, roots: list[str], enable_lora: bool,
               env: Mapping[str, str] | None = None) -> RuntimeLoRAUpdates:
        """Resolve the deploy file's options for one model. `allow` is the option as given (None:
        not given, so the environment decides); ValueError naming the option when they cannot
        be honoured."""
        if not enable_lora:
            if allow:
                raise ValueError(f"{OPTION}=true needs enable_lora=true (or a lora_config): this model serves "
                                 "no LoRA adapters")
            if roots:
                raise ValueError(f"{ROOTS_OPTION} {roots!r} needs enable_lora=true (or a lora_config)")
            return cls(False, ())
        resolved = []
        for root in roots:
            folder = Path(root).expanduser()
            if not folder.is_dir():
                raise ValueError(f"{ROOTS_OPTION}: {root!r} is not a directory")
            resolved.append(str(folder.resolve()))
        enabled = env_allows_runtime_lora_updating(env) if allow is None else allow
        if enabled and not resolved:
            source = (f"{OPTION}=true" if allow is not None
                      else f"{RUNTIME_LORA_ENV}={(os.environ if env is None else env)[RUNTIME_LORA_ENV]!r}")
            raise ValueError(f"{ROOTS_OPTION} is empty while runtime LoRA loading is on ({source}): give the "
                             f"folders /v1/load_lora_adapter may load adapters from (it never loads from anywhere "
                             f"on the server's disk), or set {OPTION}: false")
        return cls(enabled, tuple(dict.fromkeys(resolved)))

    def check_enabled(self, model: str) -> None:
        """404 (as vLLM, which has no such routes then) unless runtime loading is on for `model`."""
        if not self.enabled:
            raise disabled_error(model)

    def folder(self, lora_path: str, model: str) -> str:
        """The real folder `lora_path` names (`~` expanded, symlinks and `..` resolved) when it
        lies under one of the roots; a 400 naming the roots otherwise, which tells nothing of the
        path (not whether it exists). What is loaded is this folder, not the path as given, so
        a symlink swapped after the check changes nothing."""
        self.check_enabled(model)
        try:
            folder = Path(lora_path).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):  # no such home, a symlink loop, a NUL byte
            folder = None
        if folder is None or not any(folder.is_relative_to(root) for root in self.roots):
            raise OpenAIError(400, f"lora_path must be a folder under one of {ROOTS_OPTION} of model `{model}`: "
                                   f"{list(self.roots)}", "lora_path")
        return str(folder)


def disabled_error(model: str | None = None) -> OpenAIError:
    """The answer of /v1/load_lora_adapter and /v1/unload_lora_adapter where they are off."""
    where = f" for model `{model}`" if model else " on this server"
    return OpenAIError(404, f"Loading and unloading LoRA adapters at runtime is disabled{where}. The operator turns "
                            f"it on per model with the engine option `{OPTION}: true` (or "
                            f"{RUNTIME_LORA_ENV}=True where the app is built) and `{ROOTS_OPTION}`, the folders "
                            "adapters may be loaded from (docs/lora.md, \"Loading adapters at runtime\").")
