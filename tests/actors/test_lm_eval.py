"""lm-evaluation-harness against `serve run` (issue 42): `--model local-completions` scores
log-likelihood tasks with `echo: true, logprobs: 1, max_tokens: 1`, reading the prompt tokens'
log-probabilities back in the legacy completions shape. Its scores must equal lm-eval's own HF
backend (`--model hf`) on the same fp32 weights; that one needs no server, and runs in the background
from the module's start.

One Serve app for the module: SmolLM2-135M dequantized from its GGUF to an fp32 HF folder,
served fp32 with a small step budget (a long prompt is prefilled in chunks) and 4-token
blocks (lm-eval's choices share cached prefix blocks). The tasks read local JSONL files through
`--include_path`; nothing is downloaded (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE). lm-eval comes
with the test extra (`make test` installs it), as users install it.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import torch
import yaml

from ray_helpers import ROOT, free_port, http_status, loopback_env, stop_process, wait_for

import lm_eval  # noqa: F401  (the tool under test: installed by the test extra)

MODEL = "smol-f32"
STEP_TOKENS = 32  # max_num_batched_tokens: LONG is prefilled in three chunks
LONG = [(7919 * i + 101) % 40000 + 300 for i in range(70)]  # token ids, 17 full blocks of 4
# A log-likelihood task (multiple choice: acc, acc_norm) and a generation task (exact match).
MC = [("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
      ("The capital of Japan is", ["Seoul", "Tokyo", "Beijing", "Bangkok"], 1),
      ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Newton", "Pascal"], 0),
      ("The largest planet in the solar system is", ["Mars", "Venus", "Jupiter", "Mercury"], 2),
      ("A week has seven", ["days", "hours", "years", "minutes"], 0),
      ("The opposite of hot is", ["cold", "loud", "tall", "fast"], 0),
      ("Cows give us", ["milk", "wool", "silk", "steel"], 0),
      ("The sun rises in the", ["east", "west", "north", "south"], 0),
      ("Two plus two equals", ["four", "five", "three", "seven"], 0),
      ("Bees make", ["honey", "paper", "glass", "bread"], 0),
      ("Fish live in", ["water", "trees", "sand", "clouds"], 0),
      ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"], 0)]
GEN = [("The capital of France is", "Paris"), ("The capital of Italy is", "Rome"),
       ("The capital of Germany is", "Berlin"), ("The capital of Spain is", "Madrid"),
       ("The capital of Japan is", "Tokyo"), ("Two plus two is", "four"),
       ("The opposite of up is", "down"), ("Monday, Tuesday, Wednesday,", "Thursday")]
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs: {data_files: {test: DATA}}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: [".", ",", "\\n"], max_gen_toks: 8, do_sample: false, temperature: 0.0}
filter_list: [{name: strip, filter: [{function: remove_whitespace}, {function: take_first}]}]
metric_list: [{metric: exact_match, ignore_case: true, ignore_punctuation: true}]
"""


@pytest.fixture(scope="module")
def model_dir(smollm2_hf_dir) -> str:
    """SmolLM2-135M-Instruct's GGUF, dequantized by transformers, saved as an fp32 HF folder."""
    return smollm2_hf_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("serve-lm-eval")
    http_port, metrics_port = free_port(), free_port()
    deploy = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    deploy["http_options"]["port"] = http_port
    deploy["applications"][0]["args"].update(
        preset="smollm2-cpu-small", model=model_dir, dtype="float32", served_model_name=MODEL,
        max_num_batched_tokens=STEP_TOKENS, block_size=4, num_kv_blocks=1024, worker_torch_threads=1,
        response_store={"enabled": False})
    cfg = tmp / "deploy.yaml"
    cfg.write_text(yaml.safe_dump(deploy))
    log = tmp / "serve.log"
    env = loopback_env(LLM_CLUSTER_METRICS_PORT=str(metrics_port))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(cfg)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: http_status(f"{base}/health") == 200, 600, "the Serve app to be healthy", proc, log)
        yield base
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def reference(model_dir):
    """log_softmax of HF transformers' fp32 logits over a prompt: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)

    return run


def _post(base: str, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(base + path, json={"model": MODEL, **body}, timeout=300, **kwargs)


def _stats(base: str) -> dict:
    return requests.get(base + "/engine/stats", timeout=30).json()


def _check_echo(choice: dict, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """The echoed prompt leads the legacy logprobs: its first token has none; every other
    position's logprob and its `k` best alternatives are the reference's."""
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) + 1  # the prompt, then the generated token
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        row = reference[pos - 1]
        assert lps["token_logprobs"][pos] == pytest.approx(row[ids[pos]].item(), abs=2e-3)
        best = sorted(lps["top_logprobs"][pos].values(), reverse=True)[:k]
        assert best == pytest.approx(row.topk(k).values.tolist(), abs=2e-3)
    offsets = [0]
    for tok in lps["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lps["text_offset"] == offsets


# ---- echo + logprobs over HTTP ----------------------------------------------------------------
def test_echo_logprobs_equal_transformers_cached_or_not_across_chunks(server, reference):
    """A 70-token prompt (prefilled in 32-token chunks) scored cold, then again after a plain
    request put its blocks in the prefix cache: the same log-probabilities, computed whole
    each time (cached_tokens 0), and the scoring request's blocks served the plain one."""
    ref = reference(LONG)
    cold = _post(server, "/v1/completions", {"prompt": LONG, "echo": True, "logprobs": 2, "max_tokens": 1,
                                             "temperature": 0})
    assert cold.status_code == 200, cold.text
    _check_echo(cold.json()["choices"][0], LONG, ref, 2)
    plain = _post(server, "/v1/completions", {"prompt": LONG, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 68  # the cold request's 17 blocks
    warm = _post(server, "/v1/completions", {"prompt": LONG, "echo": True, "logprobs": 2, "max_tokens": 1,
                                             "temperature": 0}).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _check_echo(warm["choices"][0], LONG, ref, 2)
    assert warm["choices"][0]["logprobs"] == cold.json()["choices"][0]["logprobs"]
    assert warm["choices"][0]["prompt_logprobs"][0] is None and len(warm["choices"][0]["prompt_logprobs"]) == 70


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server):
    text = "The capital of France is"
    body = _post(server, "/v1/completions", {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    choice, n = body["choices"][0], body["usage"]["prompt_tokens"]
    assert choice["text"] == text and len(choice["logprobs"]["tokens"]) == n
    assert choice["logprobs"]["token_logprobs"][0] is None and all(v < 0 for v in choice["logprobs"]["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    # Streamed: the prompt and its logprobs in the first chunk, nothing generated after it.
    r = _post(server, "/v1/completions", {"prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0,
                                          "stream": True}, stream=True)
    chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]


def test_chat_prompt_logprobs(server, reference):
    """vLLM's extra parameter on chat: the templated prompt's logprobs beside the choices."""
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    body = _post(server, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 1,
                                                  "max_completion_tokens": 1}).json()
    got, ref = body["prompt_logprobs"], reference(ids)
    assert got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        assert got[pos][str(ids[pos])]["logprob"] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=2e-3)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 1}, "logprobs=21"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 21}, "prompt_logprobs=21"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 21},
     "prompt_logprobs=21"),
])
def test_bad_input_is_a_400_that_changes_nothing(server, path, body, param):
    before = _stats(server)
    r = _post(server, path, body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and param in (error["param"] or "") + error["message"]
    assert _stats(server) == before


# ---- lm-eval ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The two task YAMLs and their JSONL data, for `--include_path`."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    data = {"mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC],
            "gen": [{"question": q, "answer": a} for q, a in GEN]}
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(MC_TASK.replace("DATA", str(root / "mc.jsonl")))
    (root / "tiny_gen.yaml").write_text(GEN_TASK.replace("DATA", str(root / "gen.jsonl")))
    return root


class _LmEval:
    """`lm-eval run` as a user runs it, offline, started in the background; `result()` waits for
    it and returns its results file and per-sample logs."""

    def __init__(self, tasks: Path, out: Path, model: str, model_args: str, *extra: str) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_DATASETS_CACHE=str(out / "datasets"), TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
               "--tasks", "tiny_mc,tiny_gen", "--include_path", str(tasks), "--output_path", str(out),
               "--log_samples", *extra]
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.log = out, out / "lm_eval.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def result(self) -> dict:
        assert self.proc.wait(1200) == 0, self.log.read_text()[-4000:]
        out = self.out
        results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
        samples = {task: sorted((json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).open()),
                                key=lambda s: s["doc_id"]) for task in ("tiny_mc", "tiny_gen")}
        return {"results": results, "samples": samples}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def hf_backend(tasks, model_dir, tmp_path_factory):
    """lm-eval's own HF backend on the same tasks and weights. It needs no server, so it starts
    first and runs while the module's server starts and its first tests run."""
    run = _LmEval(tasks, tmp_path_factory.mktemp("lm-eval-hf"), "hf", f"pretrained={model_dir},dtype=float32",
                  "--device", "cpu", "--batch_size", "1")
    yield run
    run.stop()


@pytest.mark.timeout(2400)
def test_lm_eval_scores_equal_the_hf_backend(server, model_dir, tasks, tmp_path, hf_backend):
    ours = _LmEval(tasks, tmp_path / "ours", "local-completions",
                   f"model={MODEL},base_url={server}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={model_dir},num_concurrent=2,max_retries=1", "--batch_size", "4").result()
    hf = hf_backend.result()
    scores = {task: {m: ours["results"][task][m] for m in ours["results"][task] if m.endswith((",none", ",strip"))}
              for task in ("tiny_mc", "tiny_gen")}
    print("lm-eval scores (ours):", scores)
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            assert value == hf["results"][task][metric], (task, metric, value, hf["results"][task][metric])
    # Per request, not only the aggregate: each choice's log-likelihood and is-greedy flag, each generation.
    pairs = [(mine, theirs) for a, b in zip(ours["samples"]["tiny_mc"], hf["samples"]["tiny_mc"], strict=True)
             for mine, theirs in zip(a["filtered_resps"], b["filtered_resps"], strict=True)]
    print("largest log-likelihood difference:", max(abs(float(m[0]) - float(t[0])) for m, t in pairs))
    for (lp, greedy), (ref_lp, ref_greedy) in pairs:
        assert float(lp) == pytest.approx(float(ref_lp), abs=2e-3) and greedy == ref_greedy
    assert [s["resps"] for s in ours["samples"]["tiny_gen"]] == [s["resps"] for s in hf["samples"]["tiny_gen"]]
    # Not degenerate: the model knows most of these.
    assert scores["tiny_mc"]["acc,none"] > 0.5 and scores["tiny_gen"]["exact_match,strip"] > 0.5
