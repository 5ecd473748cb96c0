"""Request entry: the one validation pass, every check that can reject a request before it
is queued.

It runs once per request, where the request enters: in the HTTP ingress, or in the offline
`LLM`. `process` returns the validated `EngineRequest` (its sampling params resolved against
the tokenizer), which `EngineCore.add_request` admits without checking again; the core adds
only what the engine alone knows (its KV capacity, its queue).
"""
from __future__ import annotations

import msgspec

from cluster.config import EngineConfig
from cluster.messages import EngineRequest
from cluster.sample.logits_processor import load_custom_logitsprocs, validate_request_params
from cluster.sample.thinking_budget import validate_thinking_budget
from cluster.sampling_params import SamplingParams
from cluster.structured_output import validate_structured_outputs


class InputProcessor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.vocab_size = config.model_config.vocab_size
        self.max_model_len = config.model_config.max_model_len
        self.custom_procs = load_custom_logitsprocs(config)
        self.limits = config.limits_config
        self.policy = config.scheduler_config.scheduling_policy

    def check_text(self, num_chars: int, field: str = "prompt") -> None:
        """Refuse, before tokenizing it, text that cannot fit the context whatever it
        tokenizes to (each token covers at most `max_token_chars` characters)."""
        limit = self.max_model_len * self.config.model_config.get_tokenizer().max_token_chars
        if num_chars > limit:
            raise ValueError(f"{field} is too long: {num_chars} characters cannot fit this model's maximum "
                             f"context length of {self.max_model_len} tokens (at most {limit} characters)")

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary "
                             f"[0, {self.vocab_size}): {bad[:8]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt length {len(prompt_token_ids)} leaves no room for output "
                             f"within max_model_len={self.max_model_len}")

    def check_max_tokens(self, prompt_len: int, max_tokens: int | None) -> None:
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens={max_tokens} does not fit: this model's maximum context length is "
                f"{self.max_model_len} tokens, and this request asks for {prompt_len + max_tokens} "
                f"({prompt_len} in the prompt, {max_tokens} in the completion). Lower max_tokens to at "
                f"most {self.max_model_len - prompt_len} or shorten the prompt.")

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' "
                             f"(this engine schedules {self.policy!r})")

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Validate against the model, the limits and the loaded processors; returns the
        params to run."""
        lim = self.limits
        if params.n > lim.max_n:
            raise ValueError(f"n={params.n} is more than this server allows (max_n={lim.max_n})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > lim.max_logprobs:
                raise ValueError(f"{name}={value} is more than this server returns "
                                 f"(max_logprobs={lim.max_logprobs})")
        params.verify_for_model(self.vocab_size)
        validate_request_params(self.custom_procs, params)
        validate_thinking_budget(params, self.config.reasoning_config)
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self._bad_words_ids(params.bad_words))
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        # A word is banned with and without a leading space: BPE tokenizes them differently.
        ids: list[list[int]] = []
        tokenizer = self.config.model_config.get_tokenizer()
        for word in words:
            for variant in {word.strip(), " " + word.strip()}:
                toks = tokenizer.token_ids_for(variant)
                if toks and toks not in ids:
                    ids.append(toks)
        return ids

    def process(self, request: EngineRequest) -> EngineRequest:
        """Every entry check (ValueError naming the field); returns the request to queue."""
        ids, params = request.prompt_token_ids, request.sampling_params
        self.check_prompt(ids)
        self.check_priority(request.priority)
        self.check_max_tokens(len(ids), params.max_tokens)
        checked = self.check_params(params)
        return request if checked is params else msgspec.structs.replace(request, sampling_params=checked)
