"""Two Ray nodes on one machine (both on 127.0.0.1, each with its own ports, temp dir and
resources), as docs/deploying.md deploys on several hosts: `ray start --head`, `ray start
--address` (through ray_start_loopback.py, see there why), then `serve_cli` with RAY_ADDRESS. Two engine copies of the tiny model at TP=2, one
per node (`engine_resources`), the ingress on the head (`ingress_resources`).

Every process is ours by pid: each `ray start --block` runs in its own session, and its whole
process tree (raylet, workers, agents) is recorded and killed by pid at the end; `ray stop`,
which stops every Ray cluster on the machine, is never used.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from actors.env import apply_serve_throughput_env
from fleet_helpers import close_probes, complete, healthy, probe, start_serve, tiny_app, wait_replicas, write_deploy
from ray_helpers import free_port, loopback_env, stop_process, wait_for

JOIN = Path(__file__).resolve().parent / "ray_start_loopback.py"
# The GCS declares a node dead after 3 missed 1 s health checks (default: 5 x 3 s).
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                   "RAY_health_check_failure_threshold": "3"}


def _node_ports() -> list[str]:
    ports = {"--node-manager-port": free_port(), "--object-manager-port": free_port(),
             "--metrics-export-port": free_port(), "--dashboard-agent-listen-port": free_port(),
             "--dashboard-agent-grpc-port": free_port(), "--runtime-env-agent-port": free_port()}
    return [a for flag, port in ports.items() for a in (flag, str(port))] + [
        "--min-worker-port", "0", "--max-worker-port", "0"]  # workers: random ports


def _ray_start(args: list[str], temp_dir: str, resources: dict, log_path, env) -> subprocess.Popen:
    # The head: Ray's `ray start`; a second node: the same through ray_start_loopback.py, which
    # lets it join on 127.0.0.1.
    joining = "--address" in args
    cmd = [sys.executable, str(JOIN)] if joining else [os.path.join(os.path.dirname(sys.executable), "ray"), "start"]
    cmd += ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--resources", json.dumps(resources),
            "--temp-dir", temp_dir, "--object-store-memory", str(200 * 1024 * 1024), "--disable-usage-stats",
            *_node_ports(), *args]
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_started(proc: subprocess.Popen, temp_dir: str, what: str) -> None:
    """Until `ray start` says the node runs: it prints that once the node's raylet is registered
    with the GCS. (The GCS answering is not enough: a driver that connects before the head's
    raylet registered fails with "No node info found" on a busy machine.)"""
    log = Path(temp_dir) / "start.log"
    wait_for(lambda: "Ray runtime started" in log.read_text(errors="replace"), 180, what, proc, log)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_tree(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _stop_node(proc: subprocess.Popen) -> None:
    """Kill the node at once: its `ray start --block` session (the daemons it started) and the
    tree recorded before, by pid. Nothing is left to drain (Serve is stopped first), and Ray's
    graceful stop of a head takes ~30 s."""
    tree = _tree(proc)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group is the node's
    _kill_tree([p for p in tree if p.is_running()])
    proc.wait(30)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    # Short paths: Ray's Unix sockets live under the temp dir (108-character limit).
    head_dir, worker_dir = tempfile.mkdtemp(prefix="r13h", dir="/tmp"), tempfile.mkdtemp(prefix="r13w", dir="/tmp")
    env = loopback_env(**apply_serve_throughput_env({}), **FAST_NODE_DEATH)
    gcs_port, dashboard_port, http_port = free_port(), free_port(), free_port()
    gcs = f"127.0.0.1:{gcs_port}"
    nodes, serve = [], None
    try:
        head_args = ["--head", "--port", str(gcs_port), "--dashboard-host", "127.0.0.1",
                     "--dashboard-port", str(dashboard_port), "--ray-client-server-port", str(free_port())]
        nodes.append(_ray_start(head_args, head_dir, {"ingress_node": 1, "engine_slot": 1},
                                os.path.join(head_dir, "start.log"), env))
        _wait_started(nodes[0], head_dir, "the head node")
        assert healthy(f"http://127.0.0.1:{dashboard_port}/api/gcs_healthz")
        nodes.append(_ray_start(["--address", gcs], worker_dir, {"engine_slot": 1},
                                os.path.join(worker_dir, "start.log"), env))
        _wait_started(nodes[1], worker_dir, "the second node")
        deploy = write_deploy(Path(head_dir) / "deploy.yaml", http_port, [
            tiny_app("llm", tiny_llama_dir, tensor_parallel_size=2, engine_replicas=2,
                     engine_resources={"engine_slot": 1}, ingress_resources={"ingress_node": 1})])
        log = Path(head_dir) / "serve.log"
        serve = start_serve(deploy, log, RAY_ADDRESS=gcs, **apply_serve_throughput_env({}), **FAST_NODE_DEATH)
        base = f"http://127.0.0.1:{http_port}/llm"
        wait_for(lambda: healthy(base + "/health"), 600, "the app to be healthy", serve, log)
        wait_replicas(gcs, "llm", 2, 300, serve, log)
        yield {"base": base, "gcs": gcs, "nodes": nodes}
    finally:
        close_probes()
        if serve is not None:
            stop_process(serve)
        for node in reversed(nodes):
            _stop_node(node)
        shutil.rmtree(head_dir, ignore_errors=True)
        shutil.rmtree(worker_dir, ignore_errors=True)


def test_engine_copies_span_both_nodes_each_tp_group_on_one(cluster):
    placement = probe(cluster["gcs"], "placement", "llm")
    assert len(placement) == 2
    nodes = {p["node"] for p in placement.values()}
    assert len(nodes) == 2 and None not in nodes
    for replica in placement.values():
        assert replica["workers"] == [replica["node"]] * 2  # both TP ranks beside their engine
    for i in range(4):
        r = complete(cluster["base"], "llm", f"hello from request {i}", max_tokens=4, ignore_eos=True)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_killing_the_second_node_leaves_the_service_answering_from_the_first(cluster):
    before = probe(cluster["gcs"], "placement", "llm")
    _kill_tree(_tree(cluster["nodes"][1]))  # every process of the second node, at once
    killed = time.monotonic()
    answered = []
    while time.monotonic() - killed < 20:
        r = complete(cluster["base"], "llm", f"still there? {len(answered)}", max_tokens=4, ignore_eos=True,
                     timeout=60)
        assert r.status_code == 200, r.text
        answered.append(r.json()["usage"]["completion_tokens"])
    assert len(answered) >= 5 and set(answered) == {4}
    # The copy on the surviving node is the one left.
    after = wait_for(lambda: (p := probe(cluster["gcs"], "placement", "llm")) and len(p) == 1 and p, 120,
                     "the dead node's engine copy to be gone")
    (survivor,) = after
    assert survivor in before
