"""Deadlines, overload and graceful shutdown over HTTP, on one served app (`serve run` through
actors/serve_cli.py, what `make serve` runs):

- a request still queued after `max_queue_wait_s` gets 503 with Retry-After (code queue_timeout);
- one past `max_waiting` is refused at once with 503 and Retry-After;
- one running past `request_timeout_s` ends: 408 (code request_timeout) whole, an error event
  then [DONE] streamed;
- SIGTERM stops taking requests (503, Retry-After), lets every stream in flight finish, exits.
Every request sent is accounted for, and the engine ends with no block in use. The shutdown
test stops the server, so it runs last.
"""
import json
import signal
import threading

import pytest
import requests
from fleet_helpers import gcs_address, probe, start_serve, tiny_app, write_deploy
from ray_helpers import free_port, http_status, stop_process, wait_for

SLOTS = 4  # max_num_seqs: the batch the slow streams fill
STEP_DELAY_S = 0.1  # SlowStepProcessor: a stream of N tokens lasts >= N x this
QUEUE_WAIT_S = 2.0
REQUEST_TIMEOUT_S = 12.0




@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    port = free_port()
    app = tiny_app("tiny", tiny_llama_dir, max_num_seqs=SLOTS, max_waiting=1, max_queue_wait_s=QUEUE_WAIT_S,
                   request_timeout_s=REQUEST_TIMEOUT_S)
    deploy = write_deploy(tmp / "deploy.yaml", port, [app])
    log = tmp / "serve.log"
    proc = start_serve(deploy, log, LLM_CLUSTER_METRICS_PORT=str(free_port()), LLM_CLUSTER_DRAIN_TIMEOUT_S="90",
                       LLM_CLUSTER_RAY_DASHBOARD="1")  # fleet_probe.py's actor-pid reads the state API
    base = f"http://127.0.0.1:{port}/tiny"
    try:
        wait_for(lambda: http_status(f"{base}/health") == 200, 600, "the app to be healthy", proc, log)
        yield {"base": base, "proc": proc, "log": log}
    finally:
        stop_process(proc)


class Stream(threading.Thread):
    """One streamed completion of `max_tokens` slow tokens; `started` is set at its first event.
    With `release` (a file path) its tokens are slow only until that file exists."""

    def __init__(self, base: str, seed: int, max_tokens: int, release=None) -> None:
        super().__init__(daemon=True)
        slow = {"step_delay_s": STEP_DELAY_S, **({"slow_until": str(release)} if release else {})}
        self.body = {"model": "tiny", "prompt": [5 + seed] * 8, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                     "extra_args": slow}
        self.url = f"{base}/v1/completions"
        self.started = threading.Event()
        self.events: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with requests.post(self.url, json=self.body, stream=True, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        data = line[6:].decode()
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.started.set()

    def finished_whole(self, max_tokens: int) -> bool:
        *chunks, usage, done = self.events
        return (self.error is None and done == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
                and usage["usage"]["completion_tokens"] == max_tokens)


def _start(base: str, count: int, max_tokens: int, release=None) -> list[Stream]:
    """One after another: with max_waiting=1 a burst would be refused past the first."""
    streams = [Stream(base, i, max_tokens, release) for i in range(count)]
    for s in streams:
        s.start()
        assert s.started.wait(120) and s.error is None, s.error
    return streams


def _complete(base: str, **body) -> requests.Response:
    body = {"model": "tiny", "prompt": [9] * 8, "max_tokens": 4, "temperature": 0, **body}
    return requests.post(f"{base}/v1/completions", json=body, timeout=120)


def _idle(base: str) -> None:
    def idle():
        stats = requests.get(f"{base}/engine/stats", timeout=10).json()
        return stats["num_unfinished"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    wait_for(idle, 30, "the engine to hold no request and no block")


def test_queue_deadline_and_full_queue_answer_503_with_retry_after(server, tmp_path):
    base = server["base"]
    release = tmp_path / "release"
    streams = _start(base, SLOTS, max_tokens=50, release=release)  # the batch is full for >= 5 s, or until released
    queued = {}
    waiter = threading.Thread(target=lambda: queued.update(r=_complete(base)))
    waiter.start()  # takes the one waiting place ...
    wait_for(lambda: requests.get(f"{base}/engine/stats", timeout=10).json()["waiting"] == 1, 30, "a queued request")
    full = _complete(base)  # ... so this one is refused at once
    assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
    assert "queue is full" in full.json()["error"]["message"]
    waiter.join(60)
    late = queued["r"]  # still queued after QUEUE_WAIT_S: refused, nothing of it left
    assert late.status_code == 503 and late.headers["retry-after"] == "1", late.text
    assert late.json()["error"]["code"] == "queue_timeout"
    release.touch()  # the streams finish at full speed
    for s in streams:
        s.join(120)
        assert s.finished_whole(50), s.events[-3:]
    _idle(base)


def test_request_timeout_ends_a_whole_response_and_a_stream(server):
    base = server["base"]
    too_long = int(REQUEST_TIMEOUT_S / STEP_DELAY_S) + 50
    stream = Stream(base, 0, too_long)
    stream.start()
    # Its first event before the other request: with max_waiting=1 the two could race for the queue.
    assert stream.started.wait(60) and stream.error is None, stream.error
    whole = _complete(base, max_tokens=too_long, ignore_eos=True, extra_args={"step_delay_s": STEP_DELAY_S})
    assert whole.status_code == 408 and whole.json()["error"]["code"] == "request_timeout", whole.text
    stream.join(60)
    *chunks, error, done = stream.events
    assert done == "[DONE]" and error["error"]["code"] == "request_timeout"
    assert chunks and chunks[0]["object"] == "text_completion"  # it was streaming (200) before the end
    _idle(base)


def test_the_copy_runs_its_one_cpu_rank_in_the_engine_replica(server):
    """No `distributed_executor_backend` given, one rank on CPU: the engine replica runs it on a
    thread of its own (`uni`), so its namespace holds no worker actor, and it answers."""
    gcs = gcs_address(server["log"])
    (replica,) = probe(gcs, "replicas", "tiny")
    assert probe(gcs, "actor-pid", "serve", f"SERVE_REPLICA::tiny#engine#{replica}") is not None
    assert probe(gcs, "actor-pid", f"engine-{replica}", "worker-0") is None
    r = requests.post(f"{server['base']}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": [7] * 8, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_sigterm_lets_streams_in_flight_finish_and_refuses_new_ones(server, tmp_path):
    base, proc, log = server["base"], server["proc"], server["log"]
    release = tmp_path / "release"
    streams = _start(base, SLOTS, max_tokens=60, release=release)  # >= 6 s, or until released
    proc.send_signal(signal.SIGTERM)
    # Draining: the ingress refuses new work (health included) while the streams go on.
    wait_for(lambda: http_status(f"{base}/health") == 503, 30, "the ingress to drain", proc, log)
    late = _complete(base)
    assert late.status_code == 503 and late.headers["retry-after"].isdigit()
    assert "shutting down" in late.json()["error"]["message"]
    assert not any(s.events and s.events[-1] == "[DONE]" for s in streams)  # all still running
    release.touch()  # they finish at full speed, drained
    for s in streams:
        s.join(120)
        assert s.finished_whole(60), s.events[-3:]  # nothing cut
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert "Drained." in log.read_text()
