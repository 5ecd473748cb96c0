"""actors/serve_cli.py without a cluster: the local Ray start is tried again when its node
does not register in time (the 30 s Ray allows can pass on a busy 2-core machine), with the
half-started processes stopped first; any other failure is not retried."""
import socket
import subprocess
import sys

import pytest
import ray

from actors import serve_cli
from ray_helpers import ROOT, free_port, loopback_env

STARTUP_TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


def test_a_node_that_does_not_register_is_started_again_with_its_processes_stopped(monkeypatch):
    calls, leftovers = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # what a half-started node leaves: a child process of ours
            leftovers.append(subprocess.Popen(["sleep", "600"]))
            raise STARTUP_TIMEOUT
        return "context"

    monkeypatch.setattr(ray, "init", init)
    assert serve_cli._start_local_ray(9999) == "context"
    assert len(calls) == 2 and calls[1]["_node_ip_address"] == "127.0.0.1" and calls[1]["_metrics_export_port"] == 9999
    assert leftovers[0].wait(5) is not None  # stopped before the second attempt


def test_it_gives_up_after_its_attempts_and_never_retries_other_errors(monkeypatch):
    calls = []

    def timing_out(**kwargs):
        calls.append(1)
        raise STARTUP_TIMEOUT

    monkeypatch.setattr(ray, "init", timing_out)
    with pytest.raises(Exception, match="timed out during startup"):
        serve_cli._start_local_ray(9999)
    assert len(calls) == serve_cli.RAY_START_ATTEMPTS

    def refusing(**kwargs):
        calls.append(1)
        raise ValueError("bad argument")

    calls.clear()
    monkeypatch.setattr(ray, "init", refusing)
    with pytest.raises(ValueError, match="bad argument"):
        serve_cli._start_local_ray(9999)
    assert len(calls) == 1


# ---- the supervisor (actors/supervisor.py): ports checked, the server's session swept ----------
def test_the_http_listener_comes_from_the_deploy_file_or_serves_default(tmp_path):
    from actors.supervisor import http_listener

    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("http_options: {host: 127.0.0.2, port: 8123}\napplications: []\n")
    assert http_listener([str(deploy), "--reload"]) == ("127.0.0.2", 8123, f"http_options.port in {deploy}")
    deploy.write_text("applications: []\n")
    assert http_listener([str(deploy)]) == ("127.0.0.1", 8000, "Serve's default port")
    assert http_listener(["my_module:app"]) == ("127.0.0.1", 8000, "Serve's default port")


def test_a_taken_port_is_refused_naming_the_port_and_the_process_holding_it():
    import os
    import socket

    from actors.supervisor import check_ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(SystemExit) as refused:
            check_ports([("127.0.0.1", port, "http_options.port in deploy.yaml")])
        message = str(refused.value)
        assert f"port {port} on 127.0.0.1 (http_options.port in deploy.yaml) is already in use" in message
        assert f"pid {os.getpid()} (python" in message
    check_ports([("127.0.0.1", port, "the same port, closed")])  # free again: no error


def test_sweeping_a_session_stops_every_process_in_it_and_nothing_else():
    import signal
    import time

    import psutil

    from actors.supervisor import sweep_session

    # A session leader with two children, one of which ignores SIGTERM (as Ray's actors may
    # while their raylet dies); and a process outside the session that must survive.
    leader = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "subprocess.Popen(['sleep', '600'])\n"
        "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(600)'], "
        "stdout=subprocess.PIPE)\n"
        "stubborn.stdout.readline()\nprint('started', flush=True)\ntime.sleep(600)")], start_new_session=True, stdout=subprocess.PIPE, text=True)
    outsider = subprocess.Popen(["sleep", "600"])
    try:
        assert leader.stdout.readline().strip() == "started"
        members = [leader.pid] + [c.pid for c in psutil.Process(leader.pid).children()]
        assert len(members) == 3
        t0 = time.monotonic()
        assert sweep_session(leader.pid, grace_s=1.0) == 3
        assert 1.0 <= time.monotonic() - t0 < 10  # the stubborn one took its SIGKILL after the grace
        leader.wait(5)
        for pid in members:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        assert outsider.poll() is None
    finally:
        for proc in (leader, outsider):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def test_the_stop_grace_comes_from_the_environment_and_a_bad_one_stops_the_start(tmp_path, monkeypatch):
    """$LLM_CLUSTER_STOP_GRACE_S sets the seconds between SIGTERM and SIGKILL of the sweep
    (default 2); a value that is not a number >= 0 makes serve_cli exit 1 before it starts
    anything, naming the variable and the value."""
    from actors.supervisor import STOP_GRACE_ENV, stop_grace_s

    monkeypatch.delenv(STOP_GRACE_ENV, raising=False)
    assert stop_grace_s() == 2.0
    monkeypatch.setenv(STOP_GRACE_ENV, "0.5")
    assert stop_grace_s() == 0.5
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"http_options: {{host: 127.0.0.1, port: {free_port()}}}\napplications: []\n")
    for bad in ("soon", "-1", "nan"):
        env = loopback_env(**{STOP_GRACE_ENV: bad})
        done = subprocess.run([sys.executable, "-m", "actors.serve_cli", str(deploy)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 1, done.stderr
        assert f"${STOP_GRACE_ENV} must be" in done.stderr and repr(bad) in done.stderr, done.stderr
        assert "Ray" not in done.stdout  # nothing started


def test_a_dashboard_switch_other_than_1_or_0_stops_the_start(tmp_path):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(f"http_options: {{host: 127.0.0.1, port: {free_port()}}}\napplications: []\n")
    env = loopback_env(**{serve_cli.DASHBOARD_ENV: "off"})
    done = subprocess.run([sys.executable, "-m", "actors.serve_cli", str(deploy)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "$LLM_CLUSTER_RAY_DASHBOARD must be 1 or 0, got 'off'" in done.stderr
    assert "Ray" not in done.stdout  # nothing started


def test_a_local_server_checks_the_http_metrics_and_haproxy_ports(tmp_path, monkeypatch):
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("http_options: {host: 127.0.0.1, port: 8123}\napplications: []\n")
    for var in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
                "RAY_SERVE_ENABLE_HA_PROXY"):
        monkeypatch.delenv(var, raising=False)
    ports = [port for _, port, _ in serve_cli._ports([str(deploy)], 8080)]
    assert ports == [8123, 8080, 8404, 9101, 8500]  # Serve's HAProxy is on by default (actors/env.py)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
    monkeypatch.setenv("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "18500")
    assert [port for _, port, _ in serve_cli._ports([str(deploy)], 8080)][2:] == [18404, 9101, 18500]
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert [port for _, port, _ in serve_cli._ports([str(deploy)], 8080)] == [8123, 8080]


def test_loopback_ports_are_free_distinct_and_never_ephemeral(monkeypatch):
    """Ports handed to a server's listeners lie below the kernel's ephemeral range, so a starting
    Ray's port-0 binds and outgoing connections cannot take one first; a taken port is skipped."""
    from actors import env

    low = env._ephemeral_range()[0]
    ports = [env.loopback_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p < low for p in ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(env, "_ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(env, "_FIRST_FIXED_PORT", taken)  # one candidate: the taken port, then port 0
        port = env.loopback_port()
    assert port != taken
