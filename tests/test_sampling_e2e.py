"""Sampling parameters and processors end to end on the real SmolLM2 (fp32, offline LLM)."""
import sys
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from dummy_logitsprocs import DummyLogitsProcessor  # noqa: E402

PROMPTS = ["The capital of France is", "My favourite food is", "Here is a list of fruits:"]
THINK = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


class ForceStartThinking:
    """Forces the reasoning start sequence at output positions [at, at + len(seq))."""

    seq: list[int] = []
    at = 14  # well after the first forced end

    def __init__(self, config, device, is_pin_memory):
        self.rows: dict[int, list[int]] = {}

    @classmethod
    def validate_params(cls, params):
        pass

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        from cluster.sample.logits_processor import process_dict_updates

        process_dict_updates(self.rows, batch_update,
                             lambda p, _, out: out if (p.extra_args or {}).get("reenter") else None)

    def apply(self, logits):
        for row, out in self.rows.items():
            k = len(out) - self.at
            if 0 <= k < len(self.seq):
                keep = logits[row, self.seq[k]].item()
                logits[row] = float("-inf")
                logits[row, self.seq[k]] = keep
        return logits


@pytest.fixture(scope="module")
def llm(smollm2_path):
    from cluster.sample.logits_processor import LogitsProcessor

    # Registered as a subclass so the loader accepts it, like any user processor.
    LogitsProcessor.register(ForceStartThinking)
    return LLM(smollm2_path, dtype="float32", max_model_len=512, reasoning_config=THINK,
               logits_processors=[DummyLogitsProcessor, ForceStartThinking])


def _gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_seeds(llm):
    a = _gen(llm, PROMPTS[:1], temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    b = _gen(llm, PROMPTS[:1], temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    c = _gen(llm, PROMPTS[:1], temperature=1.0, seed=8, max_tokens=12, ignore_eos=True)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids


def test_n_completions_share_prompt_blocks(llm):
    hits_before = llm.engine.stats().prefix_cache_hits
    block_size = llm.config.cache_config.block_size
    prompt = "Write one sentence about the sea. " * 6  # several full KV blocks
    out = _gen(llm, [prompt], n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The second and third completion reused the first one's full prompt blocks.
    full = (len(out.prompt_token_ids) // block_size) * block_size
    assert llm.engine.stats().prefix_cache_hits - hits_before >= 2 * full


def test_logprobs_are_log_softmax_of_processed_logits(llm):
    out = _gen(llm, PROMPTS[:1], temperature=0.0, max_tokens=4, logprobs=3)[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) >= 3 and all(v.logprob <= 0 for v in pos.values())
        top = sorted(pos.values(), key=lambda v: -v.logprob)[0]
        assert pos[tok].logprob == pytest.approx(top.logprob)
    # The same from a plain forward: log_softmax of the (unprocessed, greedy) logits.
    ref = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.cumulative_logprob < 0
    assert len(ref.prompt_logprobs) == len(ref.prompt_token_ids) and ref.prompt_logprobs[0] is None


def test_prompt_logprobs_match_reference_forward(llm, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM

    ref = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    ids = torch.tensor([ref.prompt_token_ids])
    with torch.inference_mode():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    for pos in range(1, len(ref.prompt_token_ids)):
        tok = ref.prompt_token_ids[pos]
        assert ref.prompt_logprobs[pos][tok].logprob == pytest.approx(lp[pos - 1, tok].item(), abs=1e-3)


def test_custom_processor_via_extra_args(llm):
    plain = _gen(llm, PROMPTS, temperature=0.0, max_tokens=8, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args={"target_token": 42}),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True, extra_args={"target_token": 7})]
    out = llm.generate(PROMPTS, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [42] * 8
    assert out[1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert out[2].outputs[0].token_ids == [7] * 8
    with pytest.raises(ValueError, match="target_token"):
        _gen(llm, PROMPTS[:1], extra_args={"target_token": "x"})


def test_penalties_bad_words_allowed_ids_bias_min_tokens(llm):
    tok = llm.get_tokenizer()
    base = _gen(llm, ["one one one one one"], temperature=0.0, max_tokens=12, ignore_eos=True)[0].outputs[0]
    rep = _gen(llm, ["one one one one one"], temperature=0.0, max_tokens=12, ignore_eos=True,
               repetition_penalty=2.0)[0].outputs[0]
    assert base.token_ids != rep.token_ids
    assert rep.token_ids.count(base.token_ids[0]) <= base.token_ids.count(base.token_ids[0])

    first_word = base.text.split()[0]
    banned = _gen(llm, ["one one one one one"], temperature=0.0, max_tokens=12, ignore_eos=True,
                  bad_words=[first_word])[0].outputs[0]
    assert first_word not in banned.text.split()

    allowed = [tok.token_ids_for(w)[0] for w in (" yes", " no")]
    only = _gen(llm, PROMPTS[:1], temperature=1.0, seed=0, max_tokens=6, ignore_eos=True,
                allowed_token_ids=allowed)[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)

    biased = _gen(llm, PROMPTS[:1], temperature=0.0, max_tokens=3, ignore_eos=True,
                  logit_bias={allowed[1]: 100.0})[0].outputs[0]
    assert biased.token_ids == [allowed[1]] * 3

    eos = tok.eos_token_id
    short = _gen(llm, ["<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"],
                 temperature=0.0, max_tokens=40)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    longer = _gen(llm, ["<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"],
                  temperature=0.0, max_tokens=40, min_tokens=25)[0].outputs[0]
    assert len(longer.token_ids) >= 25 and eos not in longer.token_ids[:25]


def test_stop_strings(llm):
    full = _gen(llm, ["1, 2, 3, 4, 5,"], temperature=0.0, max_tokens=20, ignore_eos=True)[0].outputs[0]
    assert " 7," in full.text
    cut = _gen(llm, ["1, 2, 3, 4, 5,"], temperature=0.0, max_tokens=20, ignore_eos=True, stop=[" 7"])[0].outputs[0]
    assert cut.text == full.text[: full.text.index(" 7")] and cut.finish_reason == "stop"
    assert cut.stop_reason == " 7"
    kept = _gen(llm, ["1, 2, 3, 4, 5,"], temperature=0.0, max_tokens=20, ignore_eos=True, stop=[" 7"],
                include_stop_str_in_output=True)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(" 7") + 2]
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def _after(seq, sub, start=0):
    for i in range(start, len(seq) - len(sub) + 1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_thinking_budget_prompt_inside_think(llm, budget):
    tok = llm.get_tokenizer()
    end = tok.token_ids_for("</think>")
    assert len(end) > 1 and len(tok.token_ids_for("<think>")) > 1  # multi-token sequences
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>"
    out = _gen(llm, [prompt], temperature=0.0, max_tokens=budget + len(end) + 4, ignore_eos=True,
               thinking_token_budget=budget)[0].outputs[0].token_ids
    assert _after(out, end) == budget
    # Tokens already inside the think block in the prompt count against the budget.
    pre = tok.token_ids_for(" Let me")
    out2 = llm.generate([{"prompt_token_ids": tok.encode(prompt) + pre}],
                        SamplingParams(temperature=0.0, max_tokens=12 + len(end), ignore_eos=True,
                                       thinking_token_budget=len(pre) + budget), use_tqdm=False)
    assert _after(out2[0].outputs[0].token_ids, end) == budget


def test_thinking_budget_reentry(llm):
    tok = llm.get_tokenizer()
    start, end = tok.token_ids_for("<think>"), tok.token_ids_for("</think>")
    ForceStartThinking.seq = start
    budget = 4
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>"
    out = _gen(llm, [prompt], temperature=0.0, max_tokens=40, ignore_eos=True, thinking_token_budget=budget,
               extra_args={"reenter": True})[0].outputs[0].token_ids
    first_end = _after(out, end)
    assert first_end == budget
    restart = _after(out, start, first_end)
    assert restart == ForceStartThinking.at
    second_end = _after(out, end, restart + len(start))
    assert second_end - (restart + len(start)) == budget


def test_thinking_budget_needs_reasoning_config(tiny_llama_dir):
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="reasoning"):
        plain.generate(["hi"], SamplingParams(thinking_token_budget=3), use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
