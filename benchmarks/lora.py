"""Multi-LoRA throughput: N requests spread over K adapters against the same requests on the
base model, same run, same engine settings (SmolLM2-135M, bf16 where the CPU has it).

The adapters are made here with peft on SmolLM2's weights (rank 16 on all seven projections by
default, B random so they do change the output), saved as PEFT folders and served from
`lora_modules`. Three runs, each after a warm-up: the base model on an engine without LoRA (the
reference), the base model on an engine with `enable_lora` (what turning LoRA on costs when no
adapter runs), and the requests spread round-robin over the adapters with `max_loras` = K (the
issue's target: at least 0.8x the reference's output tokens/s). Also prints the adapters' read
time (each folder read and checked once) and the slot loads.

    .venv/bin/python benchmarks/lora.py [--num-requests 64] [--adapters 8] [--rank 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: str, root: Path, count: int, rank: int, modules: list[str]) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = {}
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                                init_lora_weights=False))
        name = f"adapter-{i}"
        model.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


def run(llm, prompts, out_len: int, loras) -> tuple[float, int]:
    from cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    warm = [{"prompt_token_ids": p[:16]} for p in prompts[: len(loras)]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False, lora_request=loras[: len(warm)])
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras[i % len(loras)] for i in range(len(prompts))])
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == len(prompts) * out_len, produced
    return elapsed, produced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    from cluster import LLM
    from cluster.lora import LoRARequest
    from cluster.model.loader import gguf_cache_dir

    engine = dict(dtype=args.dtype, max_num_seqs=args.num_requests, max_model_len=1024)
    base_llm = LLM(args.model, **engine)
    model_dir = base_llm.config.model_config.path
    if model_dir.endswith(".gguf"):  # peft needs an HF folder: the converted checkpoint our loader wrote
        model_dir = str(gguf_cache_dir(model_dir))
    rng = random.Random(0)
    vocab = base_llm.config.model_config.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]

    base_s, base_tokens = run(base_llm, prompts, args.output_len, [None])
    del base_llm
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(model_dir, Path(tmp), args.adapters, args.rank, args.modules.split(","))
        llm = LLM(args.model, **engine, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                  lora_modules=folders)
        on_s, on_tokens = run(llm, prompts, args.output_len, [None])
        loras = [LoRARequest(name) for name in folders]
        lora_s, lora_tokens = run(llm, prompts, args.output_len, loras)
        stats = llm.engine.stats()
    figures = {
        "workload": f"{args.num_requests} requests x {args.prompt_len} in / {args.output_len} out, "
                    f"{args.adapters} adapters of rank {args.rank} on {args.modules}",
        "dtype": str(llm.config.model_config.torch_dtype), "threads": torch.get_num_threads(),
        "base_tok_s": base_tokens / base_s, "base_on_lora_engine_tok_s": on_tokens / on_s,
        "adapters_tok_s": lora_tokens / lora_s,
        "adapter_read_s_mean": statistics.mean(stats.lora_load_seconds.values()),
        "adapter_read_s_max": max(stats.lora_load_seconds.values()), "slot_loads": stats.lora_slot_loads,
    }
    figures["ratio_adapters_vs_base"] = figures["adapters_tok_s"] / figures["base_tok_s"]
    figures["ratio_lora_engine_base_vs_base"] = figures["base_on_lora_engine_tok_s"] / figures["base_tok_s"]
    print(f"workload: {figures['workload']} ({figures['dtype']}, {figures['threads']} threads)")
    print(f"base model, engine without LoRA : {figures['base_tok_s']:8.1f} output tok/s")
    print(f"base model, engine with LoRA on : {figures['base_on_lora_engine_tok_s']:8.1f} output tok/s "
          f"({figures['ratio_lora_engine_base_vs_base']:.2f}x)")
    print(f"{args.adapters} adapters, mixed batch     : {figures['adapters_tok_s']:8.1f} output tok/s "
          f"({figures['ratio_adapters_vs_base']:.2f}x of the base; target >= 0.8x)")
    print(f"adapter read + check: mean {figures['adapter_read_s_mean'] * 1e3:.1f} ms, "
          f"max {figures['adapter_read_s_max'] * 1e3:.1f} ms; slot loads {figures['slot_loads']}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
