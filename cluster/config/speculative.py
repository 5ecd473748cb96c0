"""n-gram speculative decoding (vLLM's `speculative_config`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cluster.config.options import Freezable


@dataclass
class SpeculativeConfig(Freezable):
    """vLLM's `speculative_config` for n-gram (prompt lookup) speculation: each step a decoding
    request drafts up to `num_speculative_tokens` tokens by finding its last n tokens
    (`prompt_lookup_min` <= n <= `prompt_lookup_max`, longest first) earlier in its prompt or
    output and copying what followed; the model verifies them in one forward.

    When to draft (docs/speculative_decoding.md): a request drafts in a step of B decoding
    requests only while its recent acceptance rate (accepted / drafted tokens) is at least the
    rate at which drafts pay for their verification at that batch size, from a measured step
    cost model (`cluster/spec/drafter.py`). `min_acceptance_rate` replaces that threshold
    with a fixed one; `disable_by_batch_size` (vLLM's key) also stops all drafting in steps
    with more decoding requests than it."""

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float | None = None

    @classmethod
    def create(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                             f"'num_speculative_tokens': 3}}, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(value) - known)
        if extra:
            raise ValueError(f"speculative_config has unknown keys {extra}; known: {sorted(known)}")
        return cls(**value)

    def finalize(self) -> "SpeculativeConfig":
        """A resolved, frozen copy: vLLM's defaults filled in (a missing lookup bound copies the
        other, both missing: 5), every value checked (ValueError naming the field). This one is
        left as it is; a resolved one is returned as is."""
        if self.is_resolved:
            return self
        method = "ngram" if self.method == "[ngram]" else self.method  # vLLM's older spelling
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        resolved = dataclasses.replace(self, method=method, prompt_lookup_min=low, prompt_lookup_max=high)
        resolved._check()
        resolved._freeze()
        return resolved

    def _check(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method must be 'ngram' (the only method here), "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if name == "disable_by_batch_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must not "
                             f"exceed prompt_lookup_max={self.prompt_lookup_max}")
        rate = self.min_acceptance_rate
        if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                                 or not 0.0 <= rate <= 1.0):
            raise ValueError(f"speculative_config.min_acceptance_rate must be in [0, 1], got {rate!r}")
