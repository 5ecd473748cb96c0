"""The real SmolLM2 through our engine vs HF transformers' generate, token for token (fp32)."""
import pytest
import torch

from cluster import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the ocean.",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "List three primary colors:",
    "Once upon a time in a small village, there lived an old clockmaker who",
    "Q: What is the boiling point of water in Celsius?\nA:",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def hf_reference(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    model.eval()
    # Plain greedy to the full length: EOS is neither a stop nor suppressed (min_new_tokens
    # would mask it, which is not what ignore_eos means).
    model.generation_config.eos_token_id = None
    outs = {}
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(ids))
            assert gen.shape[1] == ids.shape[1] + NEW_TOKENS
            outs[p] = (ids[0].tolist(), gen[0, ids.shape[1]:].tolist())
    return outs


def _run(llm: LLM, hf_reference):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": hf_reference[p][0]} for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("variant", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8, block_size=4),
    dict(num_kv_blocks=12, block_size=16),
    # The next step planned before the last one's tokens are in; preempting steps in flight.
    dict(async_scheduling=True, num_kv_blocks=12, block_size=16, max_num_batched_tokens=32),
], ids=["default", "no-prefix-cache", "chunked-prefill-8", "tiny-kv-preempt", "async-chunked-tiny-kv"])
def test_greedy_matches_transformers(variant, hf_reference, smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", max_model_len=256, **variant)
    assert llm.engine.executor.worker.runner.attention_backend == "cpu_paged"  # "auto" on CPU
    ours = _run(llm, hf_reference)
    for prompt, got in zip(PROMPTS, ours):
        assert got == hf_reference[prompt][1], prompt
    stats = llm.engine.stats()
    if "num_kv_blocks" in variant:
        assert stats.preemptions > 0
    assert stats.num_free_blocks == stats.num_blocks
