"""Decode steps with each decoder layer as one kernel call (cluster/model/layers/fused_layer.py,
bf16 on CPU) against `enforce_eager=True` (the modular layers), end to end through the engine:
the same tokens for greedy and seeded sampling, a JSON schema, a logits processor and n-gram
speculative decoding (whose verify steps carry several rows a sequence)."""
import json

import pytest

from cluster import LLM, SamplingParams
from cluster.model.layers.fused_layer import FusedDecode
from cluster.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "min_acceptance_rate": 0.0}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def _requests():
    """(prompts, params) for one batch of two: decode steps of 1-2 rows, 3 with a draft."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 6}, {"prompt_token_ids": [900, 31, 4000, 77, 12]}]
    return [
        (prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)),
        (prompts, SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)),
        (prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={5: -100.0},
                                 min_tokens=20)),
        (prompts[1:], SamplingParams(temperature=0.0, max_tokens=40,
                                     structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))),
    ]


def _run(llm: LLM) -> list[list[list[int]]]:
    return [[o.outputs[0].token_ids for o in llm.generate(p, sp, use_tqdm=False)] for p, sp in _requests()]


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "ngram"])
def test_fused_layers_give_the_eager_tokens(tiny_llama_dir, monkeypatch, spec):
    calls = []
    run = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, h, rope: calls.append(h.shape[0]) or run(self, h, rope))
    options = dict(dtype="bfloat16", max_model_len=256, speculative_config=spec)
    want = _run(LLM(tiny_llama_dir, enforce_eager=True, **options))
    assert calls == []
    got = _run(LLM(tiny_llama_dir, **options))
    assert got == want
    assert calls and max(calls) <= 3 and (spec is None or 3 in calls)
