"""Worker actors: TP=3 over gloo on loopback equals TP=1 token for token (SmolLM2, fp32), with
speculative decoding and with async scheduling too (ranks 1 and 2 take every sampled token from
rank 0's broadcast), and a dead worker makes the executor's health check fail."""
import asyncio
import time

import pytest

from cluster.messages import EngineRequest
from cluster.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4, 5,",
    "Hello, my name is",
    "Once upon a time in a small village, there lived an old clockmaker who",
    "Q: What is the boiling point of water in Celsius?\nA:",
]
NEW_TOKENS = 16
OPTIONS = dict(dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=8)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "min_acceptance_rate": 0.0}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from cluster.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_path)


@pytest.fixture(scope="module")
def tp1_outputs(tokenizer):
    from cluster import LLM

    llm = LLM("smollm2-135m-instruct", **OPTIONS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _run(core, tokenizer, tag: str) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS):
        core.add_request(EngineRequest(rid, tokenizer.encode(p), params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in ids]


def test_tp3_over_gloo_matches_tp1(local_ray, tokenizer, tp1_outputs):
    import ray

    from actors.engine_replica.executor import RayExecutor
    from cluster.config import EngineConfig
    from cluster.engine.engine_core import EngineCore

    config = EngineConfig.from_preset("smollm2-cpu-tp3", **OPTIONS).finalize()
    assert config.parallel_config.tensor_parallel_size == 3
    executor = RayExecutor(config, namespace="tp3", worker_num_cpus=1.0, torch_threads=1)
    try:
        # Named per rank, all on this (loopback) node inside one STRICT_PACK group.
        handles = [ray.get_actor(f"worker-{r}", namespace="tp3") for r in range(3)]
        assert ray.get([h.ping.remote() for h in handles]) == [0, 1, 2]
        assert ray.get(handles[0].rendezvous_address.remote()).startswith("tcp://127.0.0.1:")
        # Plain; speculation (drafts and freed blocks come with the plan: the same workers
        # verify); async scheduling (each plan reaches the workers before the previous step's
        # tokens reach the engine: every rank fills them in itself).
        for tag, extra in (("plain", {}), ("spec", {"speculative_config": SPEC}),
                           ("async", {"async_scheduling": True})):
            core = EngineCore(EngineConfig.from_preset("smollm2-cpu-tp3", **OPTIONS, **extra).finalize(), executor)
            got = _run(core, tokenizer, tag)
            for prompt, ours, ref in zip(PROMPTS, got, tp1_outputs):
                assert ours == ref, (tag, prompt)
            stats = core.stats()
            assert stats.num_free_blocks == stats.num_blocks and not core.in_flight
            assert (stats.spec_decode_num_accepted_tokens > 0) == (tag == "spec")

        asyncio.run(executor.check_health())
        ray.kill(handles[1])
        with pytest.raises(ray.exceptions.RayActorError):  # wait until the kill has landed
            for _ in range(100):
                ray.get(handles[1].ping.remote(), timeout=30)
                time.sleep(0.1)
        with pytest.raises(ray.exceptions.RayActorError):
            asyncio.run(executor.check_health())
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def tp3_lora_case(tmp_path_factory, tiny_llama_dir):
    """A random llama that splits in 3 (6 heads, 3 KV heads), the three peft adapters of
    tests/lora_cases.py made for it, and HF + peft's greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from lora_cases import make_adapters, reference_tokens

    out = tmp_path_factory.mktemp("tp3-llama")
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    import torch

    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    adapters = make_adapters(str(out), tmp_path_factory.mktemp("tp3-adapters"))
    return str(out), adapters, reference_tokens(str(out), adapters)


def test_lora_at_tp3_matches_peft(local_ray, tp3_lora_case):
    """A, B sharded as vLLM shards them (column-parallel: B's rows, row-parallel: A's columns):
    three adapters and the base mixed in TP=3 steps give HF + peft's tokens."""
    from actors.engine_replica.executor import RayExecutor
    from cluster.config import EngineConfig
    from cluster.engine.engine_core import EngineCore
    from cluster.lora import LoRARequest

    from lora_cases import NUM_TOKENS, PROMPTS

    model_dir, adapters, reference = tp3_lora_case
    config = EngineConfig.create(model=model_dir, tensor_parallel_size=3, dtype="float32", max_model_len=256,
                                 num_kv_blocks=64, block_size=4, enable_lora=True, max_loras=2,
                                 lora_modules=adapters).finalize()
    executor = RayExecutor(config, namespace="tp3-lora", worker_num_cpus=0.5, torch_threads=1)
    try:
        core = EngineCore(config, executor)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        cases = [(name, i) for i in range(len(PROMPTS)) for name in (None, *adapters)]
        for n, (name, i) in enumerate(cases):
            core.add_request(EngineRequest(f"r{n}", PROMPTS[i], params,
                                           lora_request=None if name is None else LoRARequest(name)))
        tokens: dict[str, list[int]] = {f"r{n}": [] for n in range(len(cases))}
        while core.has_unfinished():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        assert [tokens[f"r{n}"] for n in range(len(cases))] == [reference[name][i] for name, i in cases]
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.lora_slot_loads >= 3
    finally:
        executor.shutdown()
