"""EngineConfig's resolution (cluster/config/engine.py `finalize`): the options are left as they
are, the resolved copy is frozen (its sub-configs too), resolving is idempotent and
deterministic, and the resolved config survives pickle and deepcopy (Ray sends it to actors)."""
import copy
import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from cluster.config import EngineConfig, ModelFacts

THINK = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


def options(model: str) -> EngineConfig:
    return EngineConfig.create(model=model, dtype="float32", max_num_seqs=4, reasoning_config=THINK,
                               speculative_config={"method": "[ngram]", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def resolved(tiny_llama_dir) -> EngineConfig:
    return options(tiny_llama_dir).finalize()


def test_finalize_leaves_the_options_untouched(tiny_llama_dir):
    opts = options(tiny_llama_dir)
    before = copy.deepcopy(opts)
    resolved = opts.finalize()
    assert opts == before and not opts.is_resolved and opts.facts is None
    assert opts.device == "auto" and opts.model_config.max_model_len is None and opts.model_config.hf_config is None
    assert opts.speculative_config.method == "[ngram]" and opts.speculative_config.prompt_lookup_min is None
    assert opts.reasoning_token_ids is None and opts.cache_config.kv_torch_dtype is None
    assert opts.lora_config.lora_modules is None and resolved.lora_config.lora_modules == {}  # normalized in the copy
    opts.update(max_num_seqs=5)  # still options: they change, the resolved copy does not
    assert resolved.scheduler_config.max_num_seqs == 4 and resolved.model_config is not opts.model_config


def test_the_resolved_config_carries_the_learned_facts(resolved, tiny_llama_dir):
    mc, facts = resolved.model_config, resolved.facts
    assert resolved.is_resolved and isinstance(facts, ModelFacts) and resolved.cache_config.facts is facts
    assert resolved.device in ("cpu", "cuda") and mc.max_model_len == mc.hf_config.max_position_embeddings
    assert (mc.path, mc.torch_dtype, mc.eos_token_id) == (tiny_llama_dir, torch.float32, facts.eos_token_id)
    assert mc.hf_config is facts.hf_config and mc.quant_plan is facts.quant_plan
    assert resolved.cache_config.kv_torch_dtype == torch.float32
    start, end = resolved.reasoning_token_ids
    assert start and end and (start, end) == facts.reasoning_token_ids
    spec = resolved.speculative_config
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5) and spec.is_resolved


@pytest.mark.parametrize("target, name, value", [
    ("", "device", "cpu"), ("", "speculative_config", None), ("model_config", "max_model_len", 8),
    ("model_config", "facts", None), ("cache_config", "num_kv_blocks", 8), ("scheduler_config", "max_num_seqs", 1),
    ("parallel_config", "tensor_parallel_size", 2), ("limits_config", "max_n", 1), ("lora_config", "max_loras", 2),
    ("speculative_config", "num_speculative_tokens", 1), ("facts", "eos_token_id", 0)])
def test_the_resolved_config_is_frozen(resolved, target, name, value):
    obj = getattr(resolved, target) if target else resolved
    with pytest.raises(dataclasses.FrozenInstanceError, match=rf"\b{name}\b"):
        setattr(obj, name, value)
    if target != "facts":  # ModelFacts is a frozen dataclass of its own
        with pytest.raises(dataclasses.FrozenInstanceError, match=rf"\b{name}\b"):
            delattr(obj, name)


def test_the_resolved_config_refuses_updates(resolved):
    with pytest.raises(dataclasses.FrozenInstanceError, match="resolved"):
        resolved.update(max_num_seqs=2)
    with pytest.raises(AttributeError):  # the learned names are read-only, resolved or not
        resolved.model_config.hf_config = None


def test_the_resolved_configs_lists_and_mappings_are_read_only(resolved):
    from cluster.config.options import FrozenDict

    assert resolved.reasoning_config == THINK and resolved.logits_processors == ()
    with pytest.raises(TypeError, match="resolved config is frozen"):
        resolved.reasoning_config["start"] = "<x>"
    with pytest.raises(TypeError, match="resolved config is frozen"):
        resolved.reasoning_config.update(end="<y>")
    with pytest.raises(AttributeError):
        resolved.logits_processors.append("my.module:Processor")
    for copied in (pickle.loads(pickle.dumps(resolved)), copy.deepcopy(resolved)):
        assert isinstance(copied.reasoning_config, FrozenDict) and copied.reasoning_config == THINK


def test_learned_facts_are_not_options():
    opts = EngineConfig.create()
    owners = {"path": opts.model_config, "torch_dtype": opts.model_config, "hf_config": opts.model_config,
              "eos_token_id": opts.model_config, "quant_plan": opts.model_config,
              "kv_torch_dtype": opts.cache_config, "reasoning_token_ids": opts, "facts": None}
    for learned, owner in owners.items():
        with pytest.raises(ValueError, match=f"unknown engine option '{learned}'"):
            opts.update(**{learned: None})
        if owner is not None:
            with pytest.raises(AttributeError):  # a read-only property: resolution sets `facts`
                setattr(owner, learned, None)


def test_finalize_is_idempotent_and_deterministic(resolved, tiny_llama_dir):
    assert resolved.finalize() is resolved  # an actor's finalize of the config it received
    again = options(tiny_llama_dir).finalize()
    assert again == resolved and again is not resolved and again.facts == resolved.facts


def test_the_resolved_config_survives_pickle_and_deepcopy(resolved):
    for copied in (pickle.loads(pickle.dumps(resolved)), cloudpickle.loads(cloudpickle.dumps(resolved)),
                   copy.deepcopy(resolved)):
        assert copied == resolved and copied.is_resolved and copied.finalize() is copied
        assert copied.cache_config.facts is copied.model_config.facts  # still one object
        with pytest.raises(dataclasses.FrozenInstanceError, match="max_num_seqs"):
            copied.scheduler_config.max_num_seqs = 1


def test_the_model_config_travels_as_plain_values(resolved, tiny_llama_dir):
    """Every process of a served model unpickles the resolved config: the model's transformers
    config rides in it as plain values (HFConfig), which unpickle without transformers."""
    from transformers import AutoConfig

    hf, original = resolved.model_config.hf_config, AutoConfig.from_pretrained(tiny_llama_dir)
    assert all(getattr(hf, key) == getattr(original, key) for key in original.to_dict())
    assert hf.rope_scaling == original.rope_scaling and hf.torch_dtype == original.torch_dtype
    assert hf.to_transformers().to_dict() == original.to_dict()
    code = ("import pickle, sys; c = pickle.loads(sys.stdin.buffer.read()); "
            "print(c.model_config.hf_config.hidden_size, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(resolved), capture_output=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.split() == [b"64", b"False"]


def test_with_facts_is_a_stand_in_without_resolving():
    opts = EngineConfig.create(max_num_seqs=3)
    stand_in = opts.with_facts(eos_token_id=7, reasoning_token_ids=([1], [2]))
    assert opts.facts is None and not stand_in.is_resolved
    assert stand_in.model_config.eos_token_id == 7 and stand_in.reasoning_token_ids == ([1], [2])
    assert stand_in.model_config.hf_config is None and stand_in.cache_config.facts is stand_in.facts
    more = stand_in.with_facts(eos_token_id=8)
    assert (more.model_config.eos_token_id, more.reasoning_token_ids) == (8, ([1], [2]))


def test_a_served_copy_runs_one_cpu_rank_in_its_own_process_unless_told(resolved, tiny_llama_dir):
    """`distributed_executor_backend` (vLLM's option): unset, one rank on CPU resolves to `uni`
    (the engine replica runs it), several ranks to `ray` (a worker actor each); `uni` with more
    than one rank or on CUDA is refused, naming the option."""
    from cluster.config import ParallelConfig

    assert resolved.parallel_config.distributed_executor_backend == "uni"
    assert resolved.device == "cpu" and resolved.parallel_config.tensor_parallel_size == 1
    told = EngineConfig.create(model=tiny_llama_dir, dtype="float32", distributed_executor_backend="ray").finalize()
    assert told.parallel_config.distributed_executor_backend == "ray"
    ranks = ParallelConfig(tensor_parallel_size=2)
    ranks.resolve_executor("cpu")
    assert ranks.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="distributed_executor_backend='uni'.*tensor_parallel_size must be 1, got 2"):
        EngineConfig.create(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="uni").finalize()
    with pytest.raises(ValueError, match="distributed_executor_backend='uni' is for the CPU"):
        ParallelConfig(distributed_executor_backend="uni").resolve_executor("cuda")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineConfig.create(model=tiny_llama_dir, distributed_executor_backend="mp").finalize()
