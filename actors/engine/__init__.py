"""Hosting the engine: the `engine` Serve deployment and the actors it places.

- `deployment`: `EngineDeployment` (`engine`): `cluster.engine.EngineCore` and its asyncio step loop.
- `protocol`: what its calls carry (FirstItem, MuxMessage, routing keywords, errors).
- `mux`: one message per step for all of an ingress's requests.
- `executor` / `worker`: `RayExecutor` and `WorkerActor` (`worker-<rank>`), one per TP rank.
- `grammar`: `GrammarCompilerActor` (`grammar-compiler`), the threaded xgrammar compile service.

Nothing here imports actors/http or actors/fleet.
"""
