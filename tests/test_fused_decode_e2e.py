"""Decode steps with each decoder layer as one kernel call (cluster/model/layers/fused_layer.py,
bf16 on CPU) against `enforce_eager=True` (the modular layers), end to end through the engine:
the same tokens for greedy and seeded sampling, a JSON schema, a logits processor and n-gram
speculative decoding (whose verify steps carry several rows a sequence); an int8 fp32 model over a
bf16 KV cache (kv_cache_dtype), whose attention rounds to the cache's dtype on both paths; and an
fp32 model."""
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


BF16 = dict(dtype="bfloat16")
# llama.cpp's mix: fp32 activations, a 16-bit cache (an fp32 model's layers fuse when quantized)
MIXED = dict(dtype="float32", kv_cache_dtype="bfloat16", quantization="int8")
# fp32 weights packed for oneDNN get the skinny layout too (named: the start-up timing may keep F.linear)
FP32 = dict(dtype="float32")


@pytest.mark.parametrize("spec,dtypes", [(None, BF16), (SPEC, BF16), (None, MIXED), (None, FP32)],
                         ids=["plain", "ngram", "fp32-bf16-cache", "fp32"])
def test_fused_layers_give_the_eager_tokens(tiny_llama_dir, monkeypatch, spec, dtypes):
    if dtypes is FP32:
        monkeypatch.setenv("LLM_CLUSTER_CPU_GEMM", "onednn")
    calls = []
    run = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, h, rope: calls.append(h.shape[0]) or run(self, h, rope))
    options = dict(max_model_len=256, speculative_config=spec, **dtypes)
    want = _run(LLM(tiny_llama_dir, enforce_eager=True, **options))
    assert calls == []
    llm = LLM(tiny_llama_dir, **options)
    got = _run(llm)
    assert got == want
    fused = next(m.fused_decode for m in llm.engine.executor.worker.runner.model.modules()
                 if getattr(m, "fused_decode", None) is not None)
    assert calls and max(calls) <= fused.max_rows and (spec is None or 3 in calls)
