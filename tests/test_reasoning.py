"""Reasoning and structured output together: the token-stream tracker, rank 0's grammar gate
(real xgrammar), and the real SmolLM2 (fp32, greedy) thinking freely, ending (forced or not)
and answering in a schema, with neighbours untouched, under preemption, n > 1 and cache hits."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest

from cluster import LLM, SamplingParams
from cluster import StructuredOutputsParams as SO
from cluster.config import EngineConfig
from cluster.reasoning import Phase, ReasoningMarkers, count_reasoning_tokens
from cluster.structured_output import StructuredOutputManager

S, E = (10, 11), (12, 13)
M = ReasoningMarkers(S, E)
THINK = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
PERSON = {"type": "object", "required": ["name", "age"], "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


# ---- the tracker ------------------------------------------------------------------------------
def test_prompt_states():
    assert M.tracker([1, 10, 11, 5], constrained=True).phase is Phase.THINKING
    assert M.tracker([1, 10, 11, 5, 12, 13], constrained=True).phase is Phase.ANSWER  # after a closed block
    assert M.tracker([1, 12, 13], constrained=True).phase is Phase.ANSWER  # a bare end: reasoning is over
    assert ReasoningMarkers((10,), E).tracker([1, 2], constrained=True).phase is Phase.OPEN
    assert M.tracker([1, 2]).phase is Phase.OUTSIDE
    assert M.tracker([1, 10, 11, 12, 13]).phase is Phase.OUTSIDE


def test_constrained_stream_routes_only_the_answer():
    tr = M.tracker([1, 10, 11], constrained=True)
    assert [tr.feed(t) for t in [5, 6, 12, 13, 7, 10, 11, 8]] == [False] * 4 + [True] * 4
    assert tr.phase is Phase.ANSWER and tr.forced_token() is None  # a start inside the answer is text


def test_open_prompt_either_thinks_or_answers():
    one = ReasoningMarkers((10,), E)  # a one-token start, like Qwen3's <think>
    tr = one.tracker([1], constrained=True)
    assert tr.phase is Phase.OPEN and tr.feed(7) and tr.phase is Phase.ANSWER
    tr = one.tracker([1], constrained=True, budget=2)
    assert [tr.feed(t) for t in (10, 5, 6)] == [False] * 3 and tr.phase is Phase.THINKING
    assert tr.forced_token() == 12  # the budget of two is spent
    assert not tr.feed(12) and tr.forced_token() == 13
    assert not tr.feed(13) and tr.phase is Phase.ANSWER and tr.feed(9)
    # A start of several tokens cannot be told from text by its first token: answer at once.
    assert M.tracker([1], constrained=True).phase is Phase.ANSWER


def test_unconstrained_blocks_re_arm_and_count():
    tr = M.tracker([10, 11], budget=1)
    for t in (5, 12, 13, 6, 10, 11):
        tr.feed(t)
    assert tr.phase is Phase.THINKING and tr.forced_token() is None
    tr.feed(7)
    assert tr.forced_token() == 12
    assert count_reasoning_tokens(M, [10, 11], [5, 6, 12, 13, 7, 10, 11, 8]) == 4
    assert count_reasoning_tokens(M, [1], [10, 11, 5, 12, 13, 7]) == 5
    assert count_reasoning_tokens(M, [1], [5, 6]) == 0
    assert count_reasoning_tokens(M, [1], [5, 10, 11, 6, 12, 13]) == 0  # a block inside the answer


def test_rebuilt_tracker_equals_the_incremental_one():
    """What a resumed or re-sent request relies on: state = f(prompt, outputs)."""
    rng = random.Random(0)
    alphabet = [10, 11, 12, 13, 1, 2]
    for _ in range(300):
        prompt = [rng.choice(alphabet) for _ in range(rng.randint(0, 6))]
        out = [rng.choice(alphabet) for _ in range(rng.randint(0, 12))]
        kw = dict(constrained=rng.random() < 0.5, budget=rng.choice([None, 0, 2]))
        live = M.tracker(prompt, **kw)
        routed = []
        for k, t in enumerate(out):
            routed.append(live.feed(t))
            assert live == M.tracker(prompt, out[:k + 1], **kw)


# ---- rank 0's gate: real xgrammar over SmolLM2's vocabulary -------------------------------------
@pytest.fixture(scope="module")
def gate(tiny_llama_dir):
    from cluster.structured_output import GrammarCompileService

    cfg = EngineConfig.create(model=tiny_llama_dir, reasoning_config=THINK).finalize()
    tok = cfg.model_config.get_tokenizer()
    grammar = GrammarCompileService.for_model(cfg).compile(SO(json=PERSON, disable_any_whitespace=True))
    return StructuredOutputManager.for_model(cfg), grammar, tok, cfg


def _allowed(mgr, rid: str) -> set[int] | None:
    import torch

    mask = mgr.fill_bitmask([(0, rid)], 1)
    if 0 not in mgr._filled_rows:
        return None  # the row is free
    bits = ((mask[0].to(torch.int64) & 0xFFFFFFFF).unsqueeze(1) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


def test_gate_keeps_thinking_free_then_constrains(gate):
    mgr, grammar, tok, cfg = gate
    start, end = cfg.reasoning_token_ids
    eos = cfg.model_config.eos_token_id
    # After a closed block the grammar constrains from the first token.
    mgr.add("closed", grammar, [], tok.encode("<think>\nok\n</think>\n", False))
    first = _allowed(mgr, "closed")
    assert first and start[0] not in first and eos not in first
    # Markers are token sequences: "<think>" after a newline is [<, think, >].
    prompt = tok.encode("user: hi\nassistant:\n<think>\n", False)
    mgr.add("t", grammar, [], prompt)
    mgr.add("t-eos", grammar, [], prompt, ignore_eos=True)
    assert _allowed(mgr, "t") is None  # thinking: untouched logits
    assert _allowed(mgr, "t-eos") == set(range(cfg.model_config.vocab_size)) - {eos}  # eos would end it
    thought = tok.encode("I think", False)
    for t in thought + end:
        assert mgr.accept("t", t)  # thinking tokens never reach the matcher
    assert _allowed(mgr, "t") == first
    # Rebuilt from the outputs (preemption, re-sent request): the same state.
    mgr.add("t2", grammar, thought + end, prompt)
    assert _allowed(mgr, "t2") == first
    # Without markers SmolLM2's three-token <think> cannot start: the answer begins at once.
    mgr.add("open", grammar, [], tok.encode("user: hi\nassistant:", False))
    assert _allowed(mgr, "open") == first
    for rid in ("t", "t-eos", "t2", "closed", "open"):
        mgr.remove(rid)
    assert not mgr.gates and not mgr.matchers
    # A one-token start marker may open a block at the first position instead.
    one = StructuredOutputManager(mgr.tokenizer_info, reasoning=ReasoningMarkers((start[0],), tuple(end)))
    one.add("open", grammar, [], tok.encode("user: hi\nassistant:", False))
    assert _allowed(one, "open") == first | {start[0]}
    assert one.accept("open", start[0]) and _allowed(one, "open") is None


# ---- the real model ---------------------------------------------------------------------------
def chat(user: str, prefix: str = "", history: str = "") -> str:
    return f"{history}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{prefix}"


# A worked example teaches SmolLM2 to close its own thinking block.
SHOT = chat("Describe a cat as JSON.", '<think>\nA cat has a name and an age. Tom is 3.\n</think>\n'
            '{"name": "Tom", "age": 3}<|im_end|>\n')
BUDGET = 10


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_model_len=512, max_num_seqs=8, reasoning_parser="qwen3")


def _split(llm, out) -> tuple[list[int], list[int]]:
    """(thinking tokens through the end marker, answer tokens)."""
    end = llm.config.reasoning_token_ids[1]
    ids = out.outputs[0].token_ids
    at = next(i for i in range(len(ids)) if ids[i:i + len(end)] == end)
    return ids[:at + len(end)], ids[at + len(end):]


def test_think_then_answer_in_the_schema_neighbours_untouched(llm):
    schema = SO(json=PERSON, disable_any_whitespace=True)
    constrained = [(chat("Describe a person as JSON.", "<think>\n"), BUDGET),  # forced end
                   (chat("Describe a dog as JSON.", "<think>\n", SHOT), None)]  # natural end
    free = [(chat(q), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for q in ("Tell me about cats.", "Count to five.")]
    alone = llm.generate([p for p, _ in free], [sp for _, sp in free], use_tqdm=False)
    plain = llm.generate([p for p, _ in constrained],
                         [SamplingParams(temperature=0, max_tokens=80, thinking_token_budget=b) for _, b in constrained],
                         use_tqdm=False)
    mixed = [free[0], (constrained[0][0], SamplingParams(temperature=0, max_tokens=80, structured_outputs=schema,
                                                          thinking_token_budget=BUDGET)),
             free[1], (constrained[1][0], SamplingParams(temperature=0, max_tokens=80, structured_outputs=schema))]
    outs = llm.generate([p for p, _ in mixed], [sp for _, sp in mixed], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    for out, ref in zip([outs[1], outs[3]], plain):
        thinking, answer = _split(llm, out)
        assert thinking == _split(llm, ref)[0]  # free thinking: what the model thinks without a grammar
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(llm.tokenizer.decode(answer)), PERSON)
    # The budget counts from the start marker: the prompt's "\n" after it is one thought token.
    assert len(_split(llm, outs[1])[0]) == BUDGET - 1 + len(llm.config.reasoning_token_ids[1])
    # The unconstrained run of the same prompts leaves the schema behind after thinking.
    assert not llm.tokenizer.decode(_split(llm, plain[0])[1]).startswith("{")


def test_prompts_after_a_block_or_without_markers_answer_at_once(llm):
    schema = SO(json=PERSON, disable_any_whitespace=True)
    prompts = [chat("Describe a person as JSON.", "<think>\nok\n</think>\n"), chat("Describe a person as JSON.")]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=60, structured_outputs=schema),
                        use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    # Even pushed towards "<" (the first token of SmolLM2's <think>), no block opens.
    start = llm.config.reasoning_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=60, structured_outputs=schema, logit_bias={start[0]: 100.0})
    jsonschema.validate(json.loads(llm.generate([prompts[1]], sp, use_tqdm=False)[0].outputs[0].text), PERSON)


def test_preemption_n_and_prefix_cache(llm, smollm2_path):
    schema = SO(json=PERSON, disable_any_whitespace=True)
    prompts = [chat(f"Describe person number {i} as JSON.", "<think>\n") for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=schema, thinking_token_budget=BUDGET)
    ref = llm.generate(prompts, greedy, use_tqdm=False)
    # 8 blocks of 16 cannot hold the five sequences at once: some are preempted mid-answer or
    # mid-thought and recomputed. The n=2 request repeats prompt 0: prefix-cache hits.
    small = LLM(smollm2_path, dtype="float32", max_model_len=256, num_kv_blocks=8, block_size=16, max_num_seqs=5,
                reasoning_config=THINK)
    sampled = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=60, structured_outputs=schema,
                             thinking_token_budget=BUDGET)
    outs = small.generate(prompts + prompts[:1], [greedy] * 3 + [sampled], use_tqdm=False)
    stats = small.engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks
    assert [o.outputs[0].token_ids for o in outs[:3]] == [o.outputs[0].token_ids for o in ref]
    for comp in [o.outputs[0] for o in outs[:3]] + outs[3].outputs:
        assert comp.finish_reason == "stop", comp.text
        thinking, answer = comp.text.split("</think>")
        assert thinking.strip()
        jsonschema.validate(json.loads(answer), PERSON)
