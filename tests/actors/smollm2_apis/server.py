"""The package's `serve run` (actors.serve_cli) of deploy.yaml's application on SmolLM2, as a
subprocess on loopback.

SmolLM2 on CPU in fp32 (greedy answers compared across requests must not depend on how much of
a prompt the prefix cache held), vLLM's `qwen3` reasoning parser (<think> ... </think>) and the
`hermes` tool-call parser, an API key, two ingress replicas sharing one `response-store` whose
SQLite file lives in the test's temporary directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import requests
import yaml

from ray_helpers import ROOT, free_port, http_status, loopback_env, stop_process, wait_for

MODEL = "smol"
API_KEY = "test-key"
BEARER = {"Authorization": f"Bearer {API_KEY}"}  # the OpenAI clients' header; Anthropic's is x-api-key
BLOCK = 16  # the preset's KV block size: prefix-cache hits come in whole blocks


class SmolServer:
    """`serve run` of the package's deploy file; `restart()` stops it and starts it again."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port, self.runs = tmp, free_port(), 0
        deploy = yaml.safe_load((ROOT / "deploy.yaml").read_text())
        deploy["http_options"]["port"] = self.port
        deploy["applications"][0]["args"].update(
            preset="smollm2-cpu-small", served_model_name=MODEL, dtype="float32", max_num_seqs=32, num_kv_blocks=768,
            api_key=API_KEY, reasoning_parser="qwen3", tool_call_parser="hermes", ingress_replicas=2,
            ingress_num_cpus=0.05, response_store={"directory": str(tmp / "store"), "max_responses": 1000},
            worker_torch_threads=1)  # one thread decodes a few rows as fast as two on 2 cores, at half the CPU
        self.config = tmp / "deploy.yaml"
        self.config.write_text(yaml.safe_dump(deploy))
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.runs += 1
        self.log = self.tmp / f"serve-{self.runs}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(self.config)], cwd=ROOT,
                                         env=loopback_env(LLM_CLUSTER_METRICS_PORT=str(free_port())),
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: http_status(f"{self.base}/health") == 200, 600, "the Serve app to be healthy", self.proc,
                 self.log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.base + path, headers=BEARER, **kwargs)

    def post(self, path: str, **kwargs) -> requests.Response:
        """A POST with the key (a new connection each: the proxy spreads them over the replicas)."""
        return requests.post(self.base + path, headers=BEARER, **kwargs)

    def restart(self) -> None:
        self.stop()
        self.start()


def wait_idle(engine) -> dict:
    """The engine's stats (conftest's `engine`) once nothing is unfinished."""
    return wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 60, "the engine to go idle")
