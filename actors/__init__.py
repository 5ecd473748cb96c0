"""The Ray layer: Serve deployments and actors that host `cluster/` objects, in five rooms.

- `http/`: the `ingress` deployment (FastAPI, OpenAI-compatible) and everything between an
  HTTP body and the engine's calls: request models, chat parsing, the engine streams, answers.
- `channel/`: how a request's outputs travel between an ingress and the engine replicas: the
  protocol, the engine end (the output mux) and the ingress end (failover, demux, streams).
- `engine_replica/`: the `engine` deployment (one replica per model copy) and the actors it
  places: `worker-<rank>` per TP rank, `grammar-compiler`.
- `fleet/`: the request routers across engine replicas.
- `store/`: the Responses API's durable store and its `response-store` deployment.

Top level: `app` (the builders deploy files name: `build_app`, the short form `deploy.yaml`
uses, and `build_openai_app`, Ray Serve LLM's form), `llm_config` (that form's typed config),
`engine_args` (the engine options both forms take), `deployments` (the Serve options of each
model's engine deployment and of the ingress), `serve_cli` and `supervisor` (`make serve`),
`env` (loopback Ray) and `metrics` (every Prometheus series). http, engine_replica and fleet
each speak the channel and never import each other (the builders at the top level join them);
all may use the top level.

Nothing here holds engine logic: it places `cluster/` objects into actors and moves
msgspec bytes between them.

`from actors import LLMConfig, build_openai_app` is the typed Python API, as Ray Serve LLM's:
`serve.run(build_openai_app({"llm_configs": [LLMConfig(model_loading_config={...})]}))`. The
names load on first use, so `import actors.env` (which must run before Ray is imported) stays
free of Ray.
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.app import build_app, build_openai_app
    from actors.llm_config import LLMConfig, LLMServingArgs

_LAZY = {"LLMConfig": "actors.llm_config", "LLMServingArgs": "actors.llm_config",
         "build_openai_app": "actors.app", "build_app": "actors.app"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
