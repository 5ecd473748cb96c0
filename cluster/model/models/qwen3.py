"""Qwen3: the Llama decoder plus RMSNorm over each q and k head before rotary
(`q_norm` / `k_norm`, weights of size head_dim); biases follow `attention_bias`."""
from __future__ import annotations

from cluster.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
