"""Rank 0's sampling step: sampler, logits processors, thinking budget."""
from cluster.config import check_reasoning_config, reasoning_token_ids
from cluster.sample.metadata import SamplingMetadata
from cluster.sample.sampler import Sampler, SamplerOutput
from cluster.sample.thinking_budget import ThinkingBudget, validate_thinking_budget

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "ThinkingBudget", "check_reasoning_config",
           "reasoning_token_ids", "validate_thinking_budget"]
