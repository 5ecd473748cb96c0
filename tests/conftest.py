import os
import shutil

import pytest

# Two cores: keep torch from oversubscribing them when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines the tests build without a cache size take vLLM's CPU knob (GiB per rank): 1 GiB, not
# the default share of memory (up to 4 GiB), which every start commits page by page. Inherited
# by the servers the tests start.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Triton kernels (the GPU attention backend) run under Triton's CPU interpreter in tests. The
# flag is read when a kernel is decorated, triton's own library included, and transformers
# imports triton: so it is set here, before anything is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")


def _cpu_isas() -> list[str]:
    """Every build of the CPU kernel library this CPU can run: its own instruction set and the
    narrower ones below it."""
    import torch

    return {"AVX512": ["avx512", "avx2", "scalar"], "AVX2": ["avx2", "scalar"]}.get(
        torch.backends.cpu.get_cpu_capability(), ["scalar"])


@pytest.fixture(scope="module", params=_cpu_isas())
def ops(request):
    """The CPU kernel library's ops, built for each instruction set in turn (its op tests)."""
    from cluster.kernels import cpu_kernels

    kernels = cpu_kernels.load(request.param)
    assert kernels is not None and kernels.isa == request.param
    return kernels


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from cluster.config import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """SmolLM2's tokenizer (transformers), its GGUF vocabulary converted once: the engine's own
    load (cluster/tokenizer.py), whose on-disk cache the served apps share."""
    from cluster.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path).hf


SHARED_DIR_ENV = "LLM_CLUSTER_TEST_SHARED_DIR"  # set by tests/run_suite.py: one folder for both halves


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory, smollm2_path, smollm2_tokenizer) -> str:
    """SmolLM2-135M-Instruct's GGUF dequantized by transformers, saved as an fp32 HF folder with
    its tokenizer: the reference the parity tests load (transformers reads a GGUF slowly, once).
    Under `make test` both pytest processes use one copy: the first to ask writes it while the
    other waits on a lock."""
    import fcntl
    from pathlib import Path

    shared = os.environ.get(SHARED_DIR_ENV)
    if not shared:
        return _convert_smollm2(tmp_path_factory.mktemp("smollm2-f32"), smollm2_path, smollm2_tokenizer)
    out = Path(shared) / "smollm2-f32"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "smollm2-f32.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)  # a half-written copy of an interrupted process
            out.mkdir()
            _convert_smollm2(out, smollm2_path, smollm2_tokenizer)
            (out / "done").touch()
    return str(out)


def _convert_smollm2(out, smollm2_path: str, tokenizer) -> str:
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    src = Path(smollm2_path)
    gguf = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = gguf.config
    del config.quantization_config  # a plain checkpoint of the dequantized weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def save_tiny_llama(out, tokenizer, **config) -> str:
    """A 2-layer random-weight llama (seed 0) with `tokenizer`, saved in `out`; `config`
    overrides its LlamaConfig."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    cfg = LlamaConfig(**{**shape, **config}, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A 2-layer random-weight llama with SmolLM2's tokenizer: fast, real code paths."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def three_kv_heads_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny llama with 6 query and 3 KV heads: at TP = 3 each rank holds one KV head."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-3kv"), smollm2_tokenizer, hidden_size=96,
                           intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="session")
def lora_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """Three peft adapters of the tiny llama (tests/lora_cases.py): name -> folder, one root."""
    from lora_cases import make_adapters

    return make_adapters(tiny_llama_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="session")
def lora_reference(tiny_llama_dir, lora_adapters):
    from lora_cases import reference_tokens

    return reference_tokens(tiny_llama_dir, lora_adapters)
