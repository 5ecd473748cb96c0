"""`python -m actors.serve_cli deploy.yaml [serve run options]`: `serve run` kept on loopback.

What `make serve` runs. It sets the loopback environment and Ray Serve's throughput mode
(actors.env; any of those variables already set wins), starts a local Ray
on 127.0.0.1 unless RAY_ADDRESS names a cluster, with the Prometheus metrics endpoint on
$LLM_CLUSTER_METRICS_PORT (default 8080), then hands over to Ray Serve's own `serve run`.
SIGTERM stops it cleanly (a backgrounded `serve run` ignores SIGINT).
"""
from __future__ import annotations

import os
import signal
import sys

from actors.env import apply_loopback_env, apply_serve_throughput_env


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through atexit: ray.shutdown() stops the local cluster


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    apply_loopback_env()
    apply_serve_throughput_env()  # before Ray starts: its processes read these at import
    # Ray nices its worker processes (15) so batch jobs yield to the raylet; here the workers
    # are the served model, and a niced model loses its cores to any other busy process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    signal.signal(signal.SIGTERM, _terminate)
    import ray
    from ray.serve.scripts import run

    if not os.environ.get("RAY_ADDRESS") and "--address" not in argv and "-a" not in argv:
        port = int(os.environ.get("LLM_CLUSTER_METRICS_PORT", "8080"))
        # address="local": never attach to a cluster a stale /tmp/ray file points at.
        ctx = ray.init(address="local", _node_ip_address="127.0.0.1", namespace="serve",
                       _metrics_export_port=port, include_dashboard=True, dashboard_host="127.0.0.1")
        print(f"Ray on 127.0.0.1: address {ctx.address_info['gcs_address']}, "
              f"dashboard http://{ctx.dashboard_url}, metrics http://127.0.0.1:{port}/metrics", flush=True)
        signal.signal(signal.SIGTERM, _terminate)  # ray.init installed its own; ours exits cleanly
    run.main(args=argv, prog_name="serve run", standalone_mode=True)


if __name__ == "__main__":
    main()
