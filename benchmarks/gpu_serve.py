"""GPU check, serving (benchmarks/gpu_check.py runs it with `--checks serve`): `python -m
actors.serve_cli` on deploy.yaml with `preset: gpu`; a chat request, the same streamed (equal
text), and a JSON-schema request, through the OpenAI SDK when installed, else plain HTTP. Needs
Ray (the GPU kit's full bundle)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vs_vllm import stop  # benchmarks/, this script's folder

ROOT = Path(__file__).resolve().parent.parent


def _http(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                          "country": {"type": "string", "maxLength": 40}},
         "required": ["city", "country"], "additionalProperties": False}


def openai_requests(base: str, model: str) -> dict:
    """A chat request, the same streamed, and a JSON-schema request: through the OpenAI SDK when
    it is installed (the bundle carries it), else as the same HTTP calls (the stream read as SSE)."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    try:
        from openai import OpenAI
    except ImportError:
        OpenAI = None
    if OpenAI is not None:
        client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60)
        text = client.chat.completions.create(model=model, messages=question, max_tokens=24,
                                              temperature=0).choices[0].message.content
        pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=question, max_tokens=24, temperature=0, stream=True) if c.choices]
        js = client.chat.completions.create(model=model, messages=question, max_tokens=128, temperature=0,
                                            response_format=schema_fmt).choices[0].message.content
    else:
        body = {"model": model, "messages": question, "max_tokens": 24, "temperature": 0}
        text = _http(f"{base}/v1/chat/completions", body, timeout=60)["choices"][0]["message"]["content"]
        req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"]]
        js = _http(f"{base}/v1/chat/completions", {**body, "max_tokens": 128, "response_format": schema_fmt},
                   timeout=60)["choices"][0]["message"]["content"]
    try:
        parsed = json.loads(js)
        json_ok = isinstance(parsed, dict) and set(parsed) == {"city", "country"}
    except ValueError:
        json_ok = False
    return {"serve_client": "openai SDK" if OpenAI is not None else "urllib", "serve_reply": text,
            "serve_chat_ok": bool(text and text.strip()), "serve_stream_ok": "".join(pieces) == text,
            "serve_stream_chunks": len(pieces), "serve_json_reply": js, "serve_json_ok": json_ok}


def check_serve(port: int, timeout_s: float) -> dict:
    """deploy.yaml with `preset: gpu` on `port`, run by `python -m actors.serve_cli`; ready within
    `timeout_s`, then `openai_requests`. serve_ok, what each request gave, and the log's tail when
    something failed; the server is stopped (SIGTERM, then killed after 60 s) either way."""
    import yaml

    if importlib.util.find_spec("ray") is None:
        return {"serve_ok": False, "serve_error": "ray is not installed: carry the full bundle (no GPU_NO_RAY)"}
    deploy = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    deploy["http_options"]["port"] = port
    deploy["applications"][0]["args"]["preset"] = "gpu"
    tmp = Path(tempfile.mkdtemp())
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    log = open(tmp / "serve.log", "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(tmp / "deploy.yaml")], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    base, t0, result = f"http://127.0.0.1:{port}", time.perf_counter(), {"serve_ok": False}
    try:
        while time.perf_counter() - t0 < timeout_s and proc.poll() is None:
            try:
                model = _http(f"{base}/v1/models")["data"][0]["id"]
                break
            except (OSError, KeyError, IndexError, ValueError):
                time.sleep(2)
        else:
            raise RuntimeError(f"not ready after {time.perf_counter() - t0:.0f} s (exit code {proc.poll()})")
        result["serve_startup_s"] = time.perf_counter() - t0
        result.update(openai_requests(base, model))
        result["serve_ok"] = all(result[k] for k in ("serve_chat_ok", "serve_stream_ok", "serve_json_ok"))
    except Exception as exc:  # reported in the JSON with the log's tail
        result["serve_error"] = repr(exc)
    finally:
        stop(proc, timeout_s=60)
        log.close()
    if not result["serve_ok"]:
        result["serve_log_tail"] = (tmp / "serve.log").read_text()[-4000:]
    return result
