"""Prompt log-probabilities (what `echo` + `logprobs` and lm-eval's log-likelihood tasks read),
computed on rank 0 from the prefill's own logits, against an HF transformers forward of the same
fp32 weights: cold, with the prompt's prefix already in the prefix cache (a request asking for
them computes its whole prompt, as vLLM V1 does, but still writes its blocks for others), and
across prefill chunks."""
import pytest
import torch

from cluster import LLM, SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    """A 70-token prompt: 4 full blocks of 16 and a partial one."""
    return [(7919 * i + 101) % 40000 + 300 for i in range(70)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompt_ids) -> torch.Tensor:
    """log_softmax of HF transformers' logits over the prompt, fp32: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _score(llm: LLM, ids: list[int], k: int | None = TOP):
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]


def _assert_matches(out, ids: list[int], reference: torch.Tensor, tol: float = 1e-4) -> None:
    """Every logprob equals the reference's for that token; the top-3 are the reference's best
    values; the prompt token's rank is its reference rank (up to near-ties: a random model's
    distribution is almost flat)."""
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry, row, tok = out.prompt_logprobs[pos], reference[pos - 1], ids[pos]
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=tol)
        best = sorted((lp.logprob for lp in entry.values()), reverse=True)[:TOP]
        assert best == pytest.approx(row.topk(TOP).values.tolist(), abs=tol)
        value = row[tok].item()
        assert int((row > value + tol).sum()) < entry[tok].rank <= int((row > value - tol).sum()) + 1


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=64)


def test_a_cached_prefix_is_recomputed_and_their_blocks_are_written(llm, prompt_ids, reference):
    """The prefix cache holds KV, not log-probabilities: a request asking for them skips its
    hits and computes the whole prompt (vLLM V1: skip_reading_prefix_cache). It still caches
    the blocks it computes, so a plain request after it reuses them."""
    assert llm.engine.block_manager.reset_prefix_cache()
    first = _score(llm, prompt_ids)  # cold
    assert first.num_cached_tokens == 0
    _assert_matches(first, prompt_ids, reference)
    plain = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0]
    assert plain.num_cached_tokens == 64  # the 4 full blocks the scoring request wrote
    again = _score(llm, prompt_ids)
    assert again.num_cached_tokens == 0
    _assert_matches(again, prompt_ids, reference)


@pytest.mark.parametrize("budget", [16, 29])
def test_prompt_logprobs_across_prefill_chunks(tiny_llama_dir, prompt_ids, reference, budget):
    """max_num_batched_tokens below the prompt's length: the prompt runs in chunks (block
    aligned, or not), each chunk's positions scored in the step that computes it."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=budget)
    plain = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    out = _score(llm, prompt_ids)  # its prefix cached by `plain`, recomputed chunk by chunk
    assert out.num_cached_tokens == 0
    _assert_matches(out, prompt_ids, reference)


def test_a_one_token_prompt_has_one_empty_position(llm):
    assert _score(llm, [4321], k=0).prompt_logprobs == [None]
    assert _score(llm, [4321, 99], k=0).prompt_logprobs[1][99].logprob < 0
