"""Deadlines: max_queue_wait_s refuses a request still queued past it, request_timeout_s ends
one still running past it; either frees its blocks and leaves the engine serving."""
import time

import pytest

from cluster import LLM, SamplingParams
from cluster.errors import QUEUE_TIMEOUT, REQUEST_TIMEOUT
from cluster.messages import EngineRequest

LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


def _engine(tiny_llama_dir, **deadlines):
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=1,
               **deadlines).engine


def _step_until(core, rid):
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} never finished")


def test_request_queued_past_max_queue_wait_is_refused(tiny_llama_dir):
    core = _engine(tiny_llama_dir, max_queue_wait_s=0.05)
    core.add_request(EngineRequest("running", [5] * 20, LONG))
    core.step()  # "running" holds the only slot
    core.add_request(EngineRequest("queued", [6] * 20, SamplingParams(n=2, max_tokens=4)))
    time.sleep(0.1)
    outs = [o for o in core.step() if o.request_id == "queued"]
    assert sorted(o.index for o in outs) == [0, 1]  # both completions, at once, no token
    assert all(o.finish_reason == "error" and o.error_code == QUEUE_TIMEOUT and not o.new_token_ids
               and "max_queue_wait_s=0.05" in o.error for o in outs)
    last = _step_until(core, "running")  # started before: the queue deadline does not touch it
    assert last.finish_reason == "length" and last.error_code is None
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.finished == {"error": 2, "length": 1}


def test_request_running_past_request_timeout_is_ended(tiny_llama_dir):
    core = _engine(tiny_llama_dir, request_timeout_s=0.5)
    core.add_request(EngineRequest("slow", [5] * 20, LONG))
    first = core.step()
    assert first[0].new_token_ids and first[0].finish_reason is None
    time.sleep(0.6)
    out = _step_until(core, "slow")
    assert out.finish_reason == "error" and out.error_code == REQUEST_TIMEOUT
    assert "request_timeout_s=0.5" in out.error
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks and not core.has_unfinished()
    core.add_request(EngineRequest("quick", [7] * 20, SamplingParams(temperature=0, max_tokens=3)))
    assert _step_until(core, "quick").finish_reason == "length"  # 3 tokens: well inside 0.5 s


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_deadlines_must_be_positive_seconds(tiny_llama_dir, value):
    for name in ("max_queue_wait_s", "request_timeout_s"):
        with pytest.raises(ValueError, match=name):
            _engine(tiny_llama_dir, **{name: value})
