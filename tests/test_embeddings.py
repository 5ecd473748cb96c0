"""Embedding models (`task="embed"`, issue 42): the engine pools each prompt's last hidden states
(LAST or MEAN, normalized unless the pooler_config says otherwise, cut to `dimensions` first),
and the vectors equal a reference written here with transformers' own model (fp32): on a
random-weight qwen3-shaped model and on SmolLM2, batched and one by one, through chunked prefill
and the prefix cache."""
import math

import pytest
from embedding_reference import max_diff, reference, tiny_qwen3

from cluster import LLM
from cluster.pooling import PoolingParams

PROMPTS = ["The capital of France is Paris, a city on the Seine.", "Embeddings map text to vectors.",
           " ".join(["one two three four five six seven eight nine ten eleven twelve thirteen"] * 4),
           "Short."]  # the third spans three 16-token blocks: cached, it is read back


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory, tiny_llama_dir) -> str:
    return tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), tiny_llama_dir)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_qwen3_embeddings_equal_transformers_batched_and_one_by_one(tiny_qwen3_dir, pooling):
    # A 16-token step budget: the longer prompts are prefilled in chunks (MEAN sums across them).
    llm = LLM(model=tiny_qwen3_dir, task="embed", dtype="float32", pooler_config={"pooling_type": pooling},
              max_num_batched_tokens=16, num_kv_blocks=64, block_size=16)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    want = reference(tiny_qwen3_dir, ids, pooling)
    batched = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    alone = [llm.embed(p, use_tqdm=False)[0].outputs.embedding for p in PROMPTS]
    assert max_diff(batched, want) < 1e-5 and max_diff(alone, want) < 1e-5
    assert all(abs(math.fsum(x * x for x in v) - 1.0) < 1e-5 for v in batched)
    # Again, now that the prompts' blocks are cached: LAST reads the cache, MEAN recomputes.
    again = llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    assert max_diff([o.outputs.embedding for o in again], want) < 1e-5
    cached = sum(o.num_cached_tokens for o in again)
    assert (cached > 0) if pooling == "LAST" else cached == 0


def test_dimensions_cut_before_normalizing_and_the_raw_vector(tiny_qwen3_dir):
    llm = LLM(model=tiny_qwen3_dir, task="embed", dtype="float32", num_kv_blocks=64)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    cut = [o.outputs.embedding for o in llm.embed(PROMPTS, PoolingParams(dimensions=24), use_tqdm=False)]
    assert all(len(v) == 24 for v in cut)
    assert max_diff(cut, reference(tiny_qwen3_dir, ids, "LAST", dimensions=24)) < 1e-5
    raw = [o.outputs.embedding for o in llm.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)]
    assert max_diff(raw, reference(tiny_qwen3_dir, ids, "LAST", normalize=False)) < 1e-4
    with pytest.raises(ValueError, match=r"dimensions must be an integer in \[1, 64\]"):
        llm.embed(PROMPTS, PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.generate(PROMPTS[0])


def test_smollm2_embeddings_equal_transformers(smollm2_path):
    from cluster.model.loader import gguf_cache_dir

    llm = LLM(model="smollm2-135m-instruct", task="embed", dtype="float32",
              pooler_config={"pooling_type": "MEAN", "normalize": True}, num_kv_blocks=64)
    ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    got = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    assert max_diff(got, reference(gguf_cache_dir(smollm2_path), ids, "MEAN")) < 1e-4


def test_a_generation_model_refuses_embed_and_bad_pooler_configs_are_named(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of"):
        LLM(model=tiny_llama_dir, task="embed", pooler_config={"pooling_type": "CLS"})
    with pytest.raises(ValueError, match="pooler_config is for task 'embed'"):
        LLM(model=tiny_llama_dir, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(model=tiny_llama_dir, task="classify")
