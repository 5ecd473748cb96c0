"""A Ray driver the scale-out tests run as a subprocess (so the test process never attaches to a
cluster): `python fleet_probe.py GCS_ADDRESS COMMAND [ARGS]`, one line `RESULT <json>` out (Ray may
print its own warnings around it). `python fleet_probe.py GCS_ADDRESS --serve` stays attached and
answers one command per stdin line (a JSON list: COMMAND, ARGS...) with one line, `RESULT <json>`
or `ERROR <json traceback>`, until stdin closes (fleet_helpers.probe: starting Python and Ray for
every question took seconds on a 2-core machine).

  status                 {app: {deployment: {state: count}}} from serve.status()
  apps                   {app: status} from serve.status() (RUNNING, DEPLOYING, ...)
  replicas APP [DEPL]    replica ids of APP's engine deployment DEPL (default `engine`) that are alive
  kill-worker NS RANK    kill worker-RANK in namespace NS; prints "dead" once it is
  actor-pid NS NAME      the process id of the live actor NAME in namespace NS (state API: needs
                         the dashboard, LLM_CLUSTER_RAY_DASHBOARD=1 for serve_cli)
  in-flight              {ingress replica id: HTTP requests in flight} from the shutdown coordinator
  placement APP          {replica id: {"node": node id, "workers": [node id per rank]}} of the
                         replicas whose engine actor is alive (state API: needs the dashboard)
"""
import json
import sys
import traceback

import ray
from ray import serve


def _replicas(app: str, deployment: str = "engine") -> list[str]:
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))


def main(gcs: str, command: str, *args: str):
    ray.init(address=gcs, log_to_driver=False, logging_level="ERROR")
    if command == "--serve":
        return serve_commands(gcs)
    print("RESULT " + json.dumps(run(gcs, command, *args)), flush=True)


def serve_commands(gcs: str) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = "RESULT " + json.dumps(run(gcs, *json.loads(line)))
        except Exception:
            out = "ERROR " + json.dumps(traceback.format_exc())
        print(out, flush=True)


def run(gcs: str, command: str, *args: str):
    if command == "status":
        return {name: {d: dict(s.replica_states) for d, s in app.deployments.items()}
                for name, app in serve.status().applications.items()}
    if command == "apps":  # {} once Serve is shut down (no controller)
        try:
            ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
        except ValueError:
            return {}
        return {name: getattr(app.status, "value", app.status) for name, app in serve.status().applications.items()}
    if command == "replicas":
        return _replicas(*args)
    if command == "kill-worker":
        worker = ray.get_actor(f"worker-{args[1]}", namespace=args[0])
        ray.kill(worker)
        try:
            ray.get(worker.ping.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return "dead"
        return "alive"
    if command == "actor-pid":
        from ray.util.state import list_actors

        found = list_actors(address=gcs, filters=[("name", "=", args[1]), ("ray_namespace", "=", args[0]),
                                     ("state", "=", "ALIVE")], detail=True)
        return found[0].pid if found else None
    if command == "in-flight":
        from actors.http.drain import coordinator

        return ray.get(coordinator().counts.remote())
    if command == "placement":
        from ray.util.state import list_actors

        alive = list_actors(address=gcs, filters=[("state", "=", "ALIVE")], detail=True, limit=10000)
        out = {}
        for rid in _replicas(args[0]):
            engine = [a for a in alive if a.name.endswith(f"#engine#{rid}")]
            if not engine:  # pending (no room for it) or gone
                continue
            workers = sorted((a for a in alive if a.ray_namespace == f"engine-{rid}" and a.name.startswith("worker-")),
                             key=lambda a: a.name)
            out[rid] = {"node": engine[0].node_id, "workers": [w.node_id for w in workers]}
        return out
    raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
