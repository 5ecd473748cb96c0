"""Per-request sampling parameters, vLLM's names and defaults, validated on construction.

`SamplingParams` is a msgspec Struct so it crosses actor boundaries inside `StepPlan` and
`EngineRequest` without pickle. Checks that need the model (token ids inside the vocab)
live in `verify_for_model`, called when a request enters the engine.
"""
from __future__ import annotations

from typing import Any

import msgspec

_GREEDY_EPS = 1e-5


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one constraint: json, json_object, regex, choice, grammar or structural_tag."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        given = self.constraints()
        if len(given) != 1:
            names = ", ".join(given) if given else "none"
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {len(given)} ({names})")
        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        kinds = {"json": (str, dict), "json_object": (bool,), "regex": (str,), "choice": (list,),
                 "grammar": (str,), "structural_tag": (str, dict)}
        for name in given:  # built from JSON bodies too: msgspec does not check types on __init__
            if not isinstance(getattr(self, name), kinds[name]):
                raise ValueError(f"structured_outputs.{name} has the wrong type "
                                 f"({type(getattr(self, name)).__name__})")

    def constraints(self) -> list[str]:
        names = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
        return [n for n in names if getattr(self, n) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.constraints()[0]


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    # Filled by the engine from `bad_words` and the tokenizer; not user input.
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters below cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        checks = [
            (_is_int(self.n) and self.n >= 1, "n", "must be at least 1"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than zero"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k",
             "must be 0 or -1 (disabled), or at least 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "max_tokens", "must be at least 1"),
            (_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
             "must be greater than or equal to 0"),
            (self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             "logprobs", "must be non-negative"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             "prompt_logprobs", "must be non-negative"),
            (self.seed is None or _is_int(self.seed), "seed", "must be an integer"),
            (self.thinking_token_budget is None or
             (_is_int(self.thinking_token_budget) and self.thinking_token_budget >= -1),
             "thinking_token_budget", "must be an integer >= 0, or -1 / None for unlimited"),
        ]
        for ok, field, rule in checks:
            if not ok:
                raise ValueError(f"{field} {rule}, got {getattr(self, field)!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}.")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty, got [].")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def unlimited_thinking(self) -> bool:
        return self.thinking_token_budget is None or self.thinking_token_budget == -1

    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every token id named must be inside the vocabulary."""
        fields = {
            "stop_token_ids": self.stop_token_ids or [],
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
        }
        for field, ids in fields.items():
            bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{field} contains token ids outside the vocabulary "
                                 f"[0, {vocab_size}): {bad[:8]}")

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
