"""How many KV blocks a rank can hold: an explicit count, a byte budget, or a memory share."""
from __future__ import annotations

import os

import torch

from cluster.config import EngineConfig

_CPU_DEFAULT_CAP = 4 << 30  # a CPU default never takes more than 4 GiB per rank


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device) -> int:
    cc = config.cache_config
    if cc.num_kv_blocks is not None:
        blocks = cc.num_kv_blocks
    elif cc.kv_cache_memory is not None:
        blocks = cc.kv_cache_memory // bytes_per_block
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - cc.gpu_memory_utilization)
        blocks = int(budget) // bytes_per_block
    else:
        budget = min(int(available_cpu_memory() * cc.cpu_kv_cache_fraction), _CPU_DEFAULT_CAP)
        blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget holds no block of {bytes_per_block} bytes; "
                         "raise kv_cache_memory / num_kv_blocks / gpu_memory_utilization")
    return int(blocks)
