"""Async scheduling (`async_scheduling=True`): step N + 1 is planned and queued on the worker
before step N's result is applied. Through the real offline engine on the tiny random model
(fp32): the outputs equal the synchronous engine's for every kind of request, including
preemption while a step is in flight, aborts between overlapping steps, and stops the engine
only sees after it planned one step more; and the steps really overlap."""
import pytest

from cluster import LLM, SamplingParams
from cluster.messages import EngineRequest, StepPlan, decode


def _llm(tiny_llama_dir, async_scheduling: bool, **kwargs) -> LLM:
    opts = dict(dtype="float32", max_model_len=256, num_kv_blocks=2048, max_num_seqs=16, seed=0)
    return LLM(tiny_llama_dir, async_scheduling=async_scheduling, **{**opts, **kwargs})


def _prompts(count: int) -> list[dict]:
    # Lengths 9 .. 130: single-block prompts, multi-block ones, prompts sharing a prefix.
    shared = list(range(300, 340))
    out = []
    for i in range(count):
        own = [(977 * i + 31 * j) % 40000 + 500 for j in range(9 + 11 * i)]
        out.append({"prompt_token_ids": (shared + own) if i % 3 == 0 else own})
    return out


def _mixed_params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=19, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                       max_tokens=21, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={stop_token: 3.0}, min_tokens=4, stop_token_ids=[stop_token],
                       max_tokens=30),
        SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, logprobs=3, prompt_logprobs=2, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, allowed_token_ids=list(range(1000, 1400)), max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=15, stop_token_ids=[stop_token]),
    ]


def _summary(outs) -> list:
    """Per prompt: its completions (tokens, finish, logprobs) and its prompt logprobs."""
    rows = []
    for o in outs:
        done = [(c.index, c.token_ids, c.finish_reason, c.stop_reason,
                 None if c.logprobs is None else [{t: round(p.logprob, 4) for t, p in pos.items()}
                                                  for pos in c.logprobs]) for c in o.outputs]
        plp = None if o.prompt_logprobs is None else [
            p and {t: round(v.logprob, 4) for t, v in p.items()} for p in o.prompt_logprobs]
        rows.append((done, plp))
    return rows


@pytest.mark.parametrize("cache", [dict(num_kv_blocks=2048), dict(num_kv_blocks=24, max_num_batched_tokens=64)],
                         ids=["ample-kv", "tiny-kv-chunked-preempting"])
def test_async_outputs_equal_sync_outputs(tiny_llama_dir, cache):
    sync, asyn = _llm(tiny_llama_dir, False, **cache), _llm(tiny_llama_dir, True, **cache)
    prompts = _prompts(10)
    # A token the model actually produces, so the stop / bias / min_tokens rows are exercised.
    probe = sync.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    params = _mixed_params(probe[0].outputs[0].token_ids[5])
    want = _summary(sync.generate(prompts, params, use_tqdm=False))
    got = _summary(asyn.generate(prompts, params, use_tqdm=False))
    assert got == want
    for (_, plp), p, prompt in zip(got, params, prompts):  # one entry per prompt position
        assert plp is None if p.prompt_logprobs is None else len(plp) == len(prompt["prompt_token_ids"])
    completions = [(c, p) for (done, _), p in zip(got, params) for c in done]
    assert any(c[2] == "stop" for c, _ in completions), "no stop token was hit: that path went untested"
    for c, p in completions:
        if c[2] == "length":
            assert len(c[1]) == p.max_tokens  # nothing past max_tokens
    for llm in (sync, asyn):
        stats = llm.engine.stats()
        assert stats.num_free_blocks == stats.num_blocks and not llm.engine.in_flight
    if cache["num_kv_blocks"] < 100:
        assert asyn.engine.stats().preemptions > 0


def test_next_step_is_queued_before_the_last_result_is_applied(tiny_llama_dir):
    events: list[tuple[str, int]] = []
    for async_scheduling in (False, True):
        llm = _llm(tiny_llama_dir, async_scheduling)
        core = llm.engine
        submit, update = core.executor.submit, core._update

        def logged_submit(plan_bytes, submit=submit):
            events.append(("submit", decode(plan_bytes, StepPlan).step))
            return submit(plan_bytes)

        def logged_update(plan, result, update=update):
            events.append(("update", plan.step))
            return update(plan, result)

        core.executor.submit, core._update = logged_submit, logged_update
        events.clear()
        for i in range(4):
            core.add_request(EngineRequest(f"r{i}", [100 + i] * 20, SamplingParams(max_tokens=8, ignore_eos=True)))
        core.step()
        if async_scheduling:  # the second step went to the worker before the first was applied
            assert events[:3] == [("submit", 1), ("submit", 2), ("update", 1)]
            assert [p.step for p, _ in core.in_flight] == [2]
        else:
            assert events[:2] == [("submit", 1), ("update", 1)] and not core.in_flight
        while core.has_unfinished():
            core.step()
        submitted = [s for kind, s in events if kind == "submit"]
        applied = [s for kind, s in events if kind == "update"]
        assert submitted == applied == sorted(applied)  # every step applied, in order
        for step in applied[:-2]:  # the last two: the final tokens, then the finished ids alone
            queued_next = events.index(("submit", step + 1)) < events.index(("update", step))
            assert queued_next == async_scheduling


def test_abort_and_new_requests_between_overlapping_steps(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for async_scheduling in (False, True):
        core = _llm(tiny_llama_dir, async_scheduling).engine
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str] = {}

        def step():
            for out in core.step():
                assert out.request_id not in finish, f"{out.request_id} got output after it finished"
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    finish[out.request_id] = out.finish_reason

        for i in range(3):
            core.add_request(EngineRequest(f"a{i}", [200 + i] * (10 + i), params))
        for _ in range(4):
            step()
        assert not async_scheduling or core.in_flight  # the abort lands while a step is queued
        for out in core.abort("a1"):
            finish[out.request_id] = out.finish_reason
        core.add_request(EngineRequest("late", [300] * 17, params))
        while core.has_unfinished():
            step()
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert finish == {"a0": "length", "a1": "abort", "a2": "length", "late": "length"}
        results[async_scheduling] = tokens
    sync, asyn = results[False], results[True]
    for rid in ("a0", "a2", "late"):
        assert asyn[rid] == sync[rid] and len(asyn[rid]) == 12
    # The abort took effect at once: nothing sampled after it reached the client.
    assert 0 < len(asyn["a1"]) < 12


def test_async_scheduling_option_is_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="async_scheduling"):
        _llm(tiny_llama_dir, True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling must be true or false"):
        _llm(tiny_llama_dir, "yes")


def test_step_async_drives_the_same_pipeline(tiny_llama_dir):
    """The engine actor's coroutine (`step_async`, awaiting the executor's futures) gives the
    synchronous engine's outputs and drains every step it queued."""
    import asyncio

    params = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True) for i in range(5)]
    prompts = _prompts(5)
    want = _summary(_llm(tiny_llama_dir, False).generate(prompts, params, use_tqdm=False))
    core = _llm(tiny_llama_dir, True).engine

    async def run() -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            core.add_request(EngineRequest(str(i), p["prompt_token_ids"], sp))
        while core.has_unfinished():
            for out in await core.step_async():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    tokens = asyncio.run(run())
    assert [tokens[str(i)] for i in range(5)] == [done[0][1] for done, _ in want]
    assert not core.in_flight and core.stats().num_free_blocks == core.stats().num_blocks
