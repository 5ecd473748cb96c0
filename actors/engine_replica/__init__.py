"""The engine replica: the `engine` Serve deployment (one model copy) and the actors it places
(`cluster/engine/` is the engine itself, without Ray).

- `deployment`: `EngineDeployment` (`engine`): `cluster.engine.EngineCore` and its asyncio step loop.
- `executor` / `worker`: `RayExecutor` and `WorkerActor` (`worker-<rank>`), one per TP rank.
- `grammar`: `GrammarCompilerActor` (`grammar-compiler`), the threaded xgrammar compile service.

Its calls speak actors/channel/ (the protocol, the engine end of the output mux). Nothing here
imports actors/http or actors/fleet.
"""
