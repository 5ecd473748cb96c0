"""Scheduling between requests, on the tiny random-weight model through the real engine:
siblings of an n > 1 request start together, a small request is not held behind a large
one, priorities order and preempt, and an abort leaves nothing behind."""
import pytest

from cluster import LLM, SamplingParams
from cluster.messages import EngineRequest

PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16 to share, and a tail


def _llm(tiny_llama_dir, **kwargs):
    opts = dict(dtype="float32", max_model_len=256, num_kv_blocks=2048, max_num_seqs=64, max_waiting=1024)
    return LLM(tiny_llama_dir, **{**opts, **kwargs})


def _add(core, rid, n=1, max_tokens=8, prompt=PROMPT, priority=0, group_id=None):
    core.add_request(EngineRequest(rid, list(prompt), SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True),
                                   priority=priority, group_id=group_id))


def _running(core, parent: str) -> int:
    return sum(r.request_id.split("#")[0] == parent for r in core.scheduler.running)


def _finish(core) -> list[str]:
    """Step until idle; the order in which requests (all their completions) finished."""
    order = []
    while core.has_unfinished():
        outs = core.step()
        for i, out in enumerate(outs):  # a request is done once its last completion is
            last = not any(o.finished and o.request_id == out.request_id for o in outs[i + 1:])
            if out.finished and last and out.request_id not in core.requests:
                order.append(out.request_id)
    return order


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


def test_siblings_start_together_once_the_prompt_is_cached(llm):
    core = llm.engine
    _add(core, "sib", n=48)
    first = core.step()
    assert _running(core, "sib") == 1  # the first computes the prompt; the others wait for its blocks
    assert [o.index for o in first] == [0]
    second = core.step()
    assert _running(core, "sib") == 48  # then every sibling starts at once (was: one per step)
    started = [o for o in second if o.index != 0]
    assert len(started) == 47 and all(o.num_cached_tokens == 32 for o in started)
    _finish(core)
    assert core.stats().num_free_blocks == core.stats().num_blocks


@pytest.mark.parametrize("num_kv_blocks", [2048, 48])  # ample, and too few for 64 sequences
def test_small_request_starts_next_step_while_max_n_request_runs(tiny_llama_dir, num_kv_blocks):
    core = _llm(tiny_llama_dir, num_kv_blocks=num_kv_blocks).engine
    _add(core, "big", n=128, max_tokens=16)  # n = max_n: twice max_num_seqs
    for _ in range(4):
        core.step()
    assert core.stats().waiting > 0 and _running(core, "big") >= 2
    _add(core, "small", max_tokens=8, prompt=PROMPT[:5])
    # The bound: the next step computes the small request's prompt and samples its first token.
    assert any(o.request_id == "small" and o.new_token_ids for o in core.step())
    order = _finish(core)
    assert order == ["small", "big"]
    stats = core.stats()
    assert stats.finished == {"length": 129} and stats.num_free_blocks == stats.num_blocks


def test_two_large_requests_share_the_batch(llm):
    core = llm.engine
    _add(core, "a", n=128, max_tokens=12)
    core.step()
    core.step()
    assert _running(core, "a") == 64
    _add(core, "b", n=128, max_tokens=12, prompt=PROMPT[::-1])
    core.step()  # b's first completion computes its prompt, taking one of a's slots
    core.step()  # then b takes slots from a until both hold an even share
    assert _running(core, "a") == _running(core, "b") == 32
    _finish(core)


@pytest.mark.parametrize("grouped", [True, False])
def test_prompts_of_one_call_are_one_share(tiny_llama_dir, grouped):
    core = _llm(tiny_llama_dir, max_num_seqs=4).engine
    for i in range(8):  # what the ingress sends for one /v1/completions call with 8 prompts
        _add(core, f"batch-{i}", max_tokens=12, group_id="call" if grouped else None)
    core.step()
    _add(core, "solo", max_tokens=4)
    started = any(o.request_id == "solo" for o in core.step())
    assert started == grouped  # as 8 separate requests they are simply older: first come, first served
    _finish(core)


def test_abort_frees_queue_entries_and_blocks_in_one_call(llm):
    core = llm.engine
    _add(core, "gone", n=128, max_tokens=100)
    for _ in range(3):
        core.step()
    busy = core.stats()
    assert busy.running == 64 and busy.waiting == 64 and busy.num_free_blocks < busy.num_blocks
    outs = core.abort("gone")
    assert sorted(o.index for o in outs) == list(range(128)) and all(o.finish_reason == "abort" for o in outs)
    after = core.stats()
    assert (after.running, after.waiting, after.num_unfinished) == (0, 0, 0)
    assert after.num_free_blocks == after.num_blocks
    core.step()  # the workers are told in the next plan; the engine serves on
    _add(core, "next", max_tokens=4)
    assert _finish(core) == ["next"]


def test_priority_orders_the_waiting_queue(tiny_llama_dir):
    core = _llm(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1).engine
    for rid, prio in [("c", 3), ("a", 1), ("b", 2)]:
        _add(core, rid, priority=prio)
    assert _finish(core) == ["a", "b", "c"]


def test_priority_preempts_the_lowest_newest_first(tiny_llama_dir):
    core = _llm(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=3).engine
    for rid, prio in [("low-old", 5), ("low-new", 5), ("mid", 3)]:
        _add(core, rid, priority=prio, max_tokens=20)
    core.step()
    _add(core, "high", priority=-1, max_tokens=20)
    core.step()  # a full batch: "high" takes the slot of the lowest priority, newest first
    assert {r.request_id for r in core.scheduler.running} == {"low-old", "mid", "high"}
    assert core.stats().preemptions == 1
    assert _finish(core)[-1] == "low-new"


def test_priority_through_the_offline_api(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["one", "two"], params, use_tqdm=False, priority=[2, 1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["one", "two"], params, use_tqdm=False, priority=[1])


def test_a_sequence_preempted_in_the_step_that_cached_its_blocks_leaves_them_uncached(tiny_llama_dir):
    """A running prefill whose next chunk was planned (its full blocks registered in the prefix
    cache) and which then loses its blocks in the same step to a higher-priority arrival never
    computes that chunk: those blocks must not stay cached for it (or anyone) to hit later.
    (The random model's greedy tokens hardly depend on the context: its logprobs do.)"""
    prompt = [(37 * i + 11) % 30000 + 700 for i in range(100)]
    other = [(53 * i + 5) % 30000 + 700 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    (alone,) = _llm(tiny_llama_dir).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    core = _llm(tiny_llama_dir, scheduling_policy="priority", num_kv_blocks=8,
                max_num_batched_tokens=64).engine
    core.add_request(EngineRequest("low", prompt, params, priority=1))
    core.step()  # its first 64 tokens
    core.add_request(EngineRequest("high", other, params, priority=0))
    core.step()  # "low" plans its last 36 (caching blocks 4, 5), then "high" takes its blocks
    assert core.stats().preemptions == 1
    tokens, logprobs = [], []
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == "low":
                tokens += out.new_token_ids
                logprobs += [row[0] for row in out.new_logprobs.logprobs]
    assert tokens == alone.outputs[0].token_ids
    want = [next(iter(pos.values())).logprob for pos in alone.outputs[0].logprobs]
    assert logprobs == pytest.approx(want, abs=1e-4)
