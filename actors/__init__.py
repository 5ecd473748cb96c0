"""The Ray layer: Serve deployments and actors that host `cluster/` objects, in three rooms.

- `http/`: the `ingress` deployment (FastAPI, OpenAI-compatible) and everything between an
  HTTP body and the engine's calls: request models, chat parsing, the engine streams, answers.
- `engine/`: the `engine` deployment (one replica per model copy) and the actors it places:
  `worker-<rank>` per TP rank, `grammar-compiler`; plus the call protocol and the output mux.
- `fleet/`: what spans engine replicas: request routers, failover, the ingress's demux.

Top level: `app.build_app` (the builder `deploy.yaml` names), `serve_cli` (`make serve`),
`env` (loopback Ray) and `metrics` (every Prometheus series). Imports go http -> fleet ->
engine, never back; all may use the top level.

Nothing here holds engine logic: it places `cluster/` objects into actors and moves
msgspec bytes between them.
"""
