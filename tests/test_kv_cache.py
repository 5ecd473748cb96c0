"""CPU memory on 2 MB transparent huge pages wherever the kernel's THP mode lets a process ask for
them (cluster/model/huge_pages.py): the paged KV cache (cluster/model/kv_cache.py), zero-filled,
and the packed weights' forms that decode steps stream (cluster/model/layers/cpu_gemm.py); and a
cache of another dtype than the model's (kv_cache_dtype)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.config import EngineConfig
from cluster.model.kv_cache import bind_kv_cache
from cluster.model.loader import load_model
from cluster.model.parallel import SINGLE

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_mode() -> str:
    return THP_MODE.read_text().split("[")[1].split("]")[0] if THP_MODE.exists() else "never"


def test_cpu_kv_cache_is_zeroed_and_on_huge_pages_where_thp_allows(tiny_llama_dir):
    config = EngineConfig.create(model=tiny_llama_dir, dtype="float32", device="cpu").finalize()
    model = load_model(config.model_config, SINGLE, torch.device("cpu"))
    caches = bind_kv_cache(model, 32768, 16, torch.bfloat16, "cpu")  # 32 MiB per K / V tensor
    mode = _thp_mode()
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (32768, 16, 2, 16) and not t.any()
            huge = _huge_kib(t.data_ptr())
            if mode == "never":
                assert huge == 0
            else:  # madvise or always: all but the unaligned ends of the tensor
                assert huge >= (t.numel() * t.element_size() >> 10) - 4096, (mode, huge)


def test_packed_weights_stream_from_huge_pages(tiny_llama_dir):
    """After loading, every packed weight's skinny form sits in one arena on huge pages (all but
    its unaligned end); moving it again changes where it is, not what a linear computes."""
    from cluster.model.layers.cpu_gemm import move_to_huge_pages

    config = EngineConfig.create(model=tiny_llama_dir, dtype="bfloat16", device="cpu").finalize()
    model = load_model(config.model_config, SINGLE, torch.device("cpu"))
    modules = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    assert modules and all(m.packed.skinny is not None for m in modules)  # SmolLM2's tied head too
    inputs = [torch.randn(2, m.packed.in_features).bfloat16() for m in modules]
    before = [m.packed.linear(x, None) for m, x in zip(modules, inputs)]
    old = [m.packed.skinny.data_ptr() for m in modules]
    moved = move_to_huge_pages(model)
    assert moved >= sum(m.packed.skinny.numel() * 2 for m in modules)
    assert all(m.packed.skinny.data_ptr() != p for m, p in zip(modules, old))
    assert all(torch.equal(m.packed.linear(x, None), want) for m, x, want in zip(modules, inputs, before))
    start = min(m.packed.skinny.data_ptr() for m in modules)
    huge = _huge_kib(start)
    if _thp_mode() == "never":
        assert huge == 0
    else:
        assert huge >= (moved >> 10) - 2048, huge


def test_bf16_cache_under_an_fp32_model(tiny_llama_dir):
    """kv_cache_dtype="bfloat16" under dtype="float32" (llama.cpp's mix): the caches are bf16, the
    same kv_cache_memory holds twice the blocks, and the prompt's log-probabilities move by the
    attention's rounding only. A kv_cache_dtype it does not have is a ValueError naming it."""
    def run(**extra):
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, **extra)
        runner = llm.engine.executor.worker.runner
        out = llm.generate({"prompt_token_ids": list(range(300, 340))},
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        lps = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i]
        return runner, torch.tensor(lps)

    fp32, want = run()
    mixed, got = run(kv_cache_dtype="bfloat16")
    assert {t.dtype for kv in mixed.kv_caches for t in kv} == {torch.bfloat16}
    assert {t.dtype for kv in fp32.kv_caches for t in kv} == {torch.float32}
    assert mixed.num_blocks == 2 * fp32.num_blocks
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for bad in ("fp8", "float16"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of .*got '{bad}'"):
            EngineConfig.create(model=tiny_llama_dir, kv_cache_dtype=bad).finalize()


def test_vllm_cpu_kvcache_space_sizes_the_default_cache(tiny_llama_dir, monkeypatch):
    """vLLM's VLLM_CPU_KVCACHE_SPACE (GiB per rank) sizes a CPU cache given no explicit size;
    num_kv_blocks and kv_cache_memory still win; a value that is not a size is refused by name."""
    from cluster.model.kv_cache import kv_cache_bytes_per_block
    from cluster.model.loader import load_hf_config

    per_block = kv_cache_bytes_per_block(load_hf_config(tiny_llama_dir), SINGLE, 16, torch.float32)
    for space, blocks in (("0.25", (1 << 28) // per_block), ("1", (1 << 30) // per_block)):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", space)
        assert LLM(tiny_llama_dir, dtype="float32", max_model_len=256).engine.stats().num_blocks == blocks
    assert LLM(tiny_llama_dir, dtype="float32", max_model_len=256,
               kv_cache_memory=per_block * 7).engine.stats().num_blocks == 7
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match=f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB >= 0, got '{bad}'"):
            LLM(tiny_llama_dir, dtype="float32", max_model_len=256)
