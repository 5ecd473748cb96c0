"""How many KV blocks a rank can hold: an explicit count, a byte budget, or a memory share.

On CUDA the share is vLLM's / nano-vLLM's: `gpu_memory_utilization` of the device's total
memory, less what is in use after loading the weights, less the peak activation memory of
the largest step, measured by `profile_peak_activation` (a forward pass over
max_num_batched_tokens prompt tokens, the LM head and the sampler's sort).

On CPU, vLLM's `VLLM_CPU_KVCACHE_SPACE` (GiB per rank) when it is set, else
`cpu_kv_cache_fraction` of the available memory, at most 4 GiB (vLLM's CPU default). The cache
is committed when it is bound (kv_cache.py), so its size is also what a start costs.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from cluster.config import EngineConfig
from cluster.model.context import build_attention_metadata, set_forward_context
from cluster.model.kv_cache import bind_kv_cache
from cluster.model.layers.attention import Attention

_CPU_DEFAULT_CAP = 4 << 30  # a CPU default never takes more than 4 GiB per rank
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_budget(fraction: float) -> int:
    """Bytes for a CPU rank's cache without an explicit size: VLLM_CPU_KVCACHE_SPACE GiB when
    set (0 or unset: the default), else `fraction` of the available memory, capped."""
    space = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    try:
        gib = float(space or 0)
    except ValueError:
        gib = -1.0
    if not 0 <= gib < float("inf"):  # NaN fails too
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV} must be a number of GiB >= 0, got {space!r}")
    if gib > 0:
        return int(gib * (1 << 30))
    return min(int(available_cpu_memory() * fraction), _CPU_DEFAULT_CAP)


def gpu_kv_budget(total: int, used: int, peak_activation: int, utilization: float) -> int:
    """Bytes left for the KV cache: this engine may use `utilization` of the device's
    `total` memory; `used` (weights, CUDA context, anything else on the device) and the
    step's `peak_activation` come off it."""
    return int(total * utilization) - used - peak_activation


def profile_lengths(max_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the profiling step: max_num_batched_tokens tokens in sequences of
    at most max_model_len, at most max_num_seqs of them (the largest step the scheduler can
    plan)."""
    lengths: list[int] = []
    left = max_tokens
    while left > 0 and len(lengths) < max_num_seqs:
        lengths.append(min(left, max_model_len))
        left -= lengths[-1]
    return lengths


def profile_peak_activation(model: nn.Module, config: EngineConfig, backend: str) -> int:
    """CUDA: bytes the largest step allocates beyond what is live before it. A KV cache just
    large enough for the step is bound for the pass (and not counted), then released."""
    sc, cc, mc = config.scheduler_config, config.cache_config, config.model_config
    device = torch.device(config.device)
    lengths = profile_lengths(sc.max_num_batched_tokens, mc.max_model_len, sc.max_num_seqs)
    seqs, first = [], 0
    for n in lengths:
        blocks = -(-n // cc.block_size)
        seqs.append((n, n, list(range(first, first + blocks))))
        first += blocks
    bind_kv_cache(model, first, cc.block_size, cc.kv_torch_dtype, device, backend)
    meta = build_attention_metadata(seqs, cc.block_size, device, backend)
    ids = torch.zeros(sum(lengths), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    rows = torch.arange(sc.max_num_seqs, device=device) % len(ids)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode(), set_forward_context(meta):
        hidden = model(ids, positions)
        logits = model.compute_logits(hidden[rows])  # collective under TP: every rank runs it
        if logits is not None:  # rank 0: the sampler's fp32 copy and top-p sort
            torch.sort(logits.float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden, logits
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.k_cache = layer.v_cache = torch.empty(0)
    torch.cuda.empty_cache()
    return peak


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device,
                  peak_activation: int = 0) -> int:
    cc = config.cache_config
    if cc.num_kv_blocks is not None:
        blocks = cc.num_kv_blocks
    elif cc.kv_cache_memory is not None:
        blocks = cc.kv_cache_memory // bytes_per_block
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        blocks = gpu_kv_budget(total, total - free, peak_activation, cc.gpu_memory_utilization) // bytes_per_block
    else:
        blocks = cpu_kv_budget(cc.cpu_kv_cache_fraction) // bytes_per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {bytes_per_block} bytes; "
                         "raise kv_cache_memory / num_kv_blocks / gpu_memory_utilization")
    return int(blocks)


def needs_profile(config: EngineConfig) -> bool:
    """Only a CUDA memory share needs the profiling pass."""
    cc = config.cache_config
    return config.device == "cuda" and cc.num_kv_blocks is None and cc.kv_cache_memory is None
