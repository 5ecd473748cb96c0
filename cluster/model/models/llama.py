"""Llama-family decoder (SmolLM2, Llama 2/3). Qwen2 and Qwen3 subclass it: they differ only
in attention biases and per-head q/k RMSNorm, switched by class attributes."""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from cluster.model.gguf_file import GGUFBlocks
from cluster.model.layers.activation import SiluAndMul
from cluster.model.layers.attention import Attention
from cluster.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cluster.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from cluster.model.layers.norm import RMSNorm
from cluster.model.layers.rotary import RotaryEmbedding, get_rope
from cluster.model.layers.weights import default_weight_loader
from cluster.model.parallel import SINGLE, ParallelContext


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _check_supported(config: Any) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError("sliding-window attention layers (use_sliding_window / layer_types) are not supported")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext, rotary: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hd = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, parallel=parallel)
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=o_bias, parallel=parallel)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd
        # Local heads: num_kv_heads counts replicated KV heads too (see local_kv_heads).
        self.rotary = rotary
        if qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = Attention(self.num_heads, hd, hd ** -0.5, self.num_kv_heads)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if not self.qk_norm and self.rotary.kernels is not None:  # rotary, KV write, attention: one call
            out = self.attn.forward_qkv(qkv, *rope)
            if out is not None:
                return self.o_proj(out)
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = nh * hd, nkv * hd
        if self.qk_norm:
            q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
            qk = torch.cat([self.q_norm(q.view(-1, nh, hd)), self.k_norm(k.view(-1, nkv, hd))], dim=1)
        else:  # q and k sit side by side in qkv: rotate them in one go
            qk = qkv[:, : q_size + kv_size].view(-1, nh + nkv, hd)
        q, k = self.rotary.apply(qk, *rope).split([nh, nkv], dim=1)
        v = qkv[:, q_size + kv_size:]
        return self.o_proj(self.attn(q.reshape(-1, q_size), k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias, parallel=parallel)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, parallel=parallel)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, parallel: ParallelContext, rotary: RotaryEmbedding,
                 biases: tuple[bool, bool], qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, parallel, rotary, *biases, qk_norm)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
                residual: torch.Tensor | None):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    fused_decode = None  # FusedDecode (layers/fused_layer.py), set at load on CPU where the layers can take it

    def __init__(self, config: Any, parallel: ParallelContext, biases: tuple[bool, bool], qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        # One rotary table shared by every layer (it is the same for all of them).
        self.rotary = rotary = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parallel, rotary, biases, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.lookup(positions, hidden.dtype)  # once per step, shared by the layers
        if self.fused_decode is not None and self.fused_decode.takes(hidden):  # every layer in one kernel call
            hidden, residual = self.fused_decode(hidden, rope)
        else:
            for layer in self.layers:
                hidden, residual = layer(rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    # checkpoint name fragment -> (our parameter fragment, shard id)
    stacked_params = {".q_proj.": (".qkv_proj.", "q"), ".k_proj.": (".qkv_proj.", "k"),
                      ".v_proj.": (".qkv_proj.", "v"), ".gate_proj.": (".gate_up_proj.", 0),
                      ".up_proj.": (".gate_up_proj.", 1)}

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def __init__(self, config: Any, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        _check_supported(config)
        self.config, self.parallel = config, parallel
        self.model = LlamaModel(config, parallel, self.attention_biases(config), self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long (a flat batch) -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> full-vocab logits [S, vocab] on rank 0, None on other ranks."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]]) -> None:
        """Load FULL checkpoint tensors (HF names); each layer keeps this rank's slice. A GGUF
        tensor served in its blocks (GGUFBlocks) goes to its layer's `load_blocks` (a tied
        head's too: the embedding gets the tensor in floats besides). Raises ValueError naming
        any parameter the checkpoint did not provide."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        expected = {(n, s) for n, p in params.items() for s in self._shards_of(n)}
        loaded: set[tuple[str, Any]] = set()
        for name, tensor in weights:
            blocks = isinstance(tensor, GGUFBlocks)
            if "rotary_emb.inv_freq" in name or (self.tied and name == "lm_head.weight" and not blocks):
                continue
            target, shard = name, None
            for frag, (ours, shard_id) in self.stacked_params.items():
                if frag in name:
                    target, shard = name.replace(frag, ours), shard_id
                    break
            if blocks:
                self._load_blocks(modules, target, tensor, shard)
                loaded.add((target, shard))
                continue
            param = params.get(target)
            if param is None:
                continue  # e.g. buffers or heads this model does not use
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))

    @staticmethod
    def _load_blocks(modules: dict[str, nn.Module], target: str, blocks: GGUFBlocks, shard: Any) -> None:
        module_name, _, kind = target.rpartition(".")
        module = modules.get(module_name)
        if kind != "weight" or not hasattr(module, "load_blocks"):
            raise ValueError(f"{target}: GGUF {blocks.gguf_type} blocks for a parameter that takes only floats")
        module.load_blocks(blocks, shard)

    def _shards_of(self, param_name: str) -> list[Any]:
        shards = [s for frag, (ours, s) in self.stacked_params.items() if ours in param_name]
        return shards or [None]
