"""The Ray layer: Serve deployments and actors that host `cluster/` objects.

- `app.build_app`: the application builder `deploy.yaml` names (typed args, presets).
- `engine.EngineDeployment` (`engine`): scheduler + block manager, the asyncio step loop.
- `executor.RayExecutor` / `worker.WorkerActor` (`worker-<rank>`): one actor per TP rank.
- `grammar.GrammarCompilerActor` (`grammar-compiler`): threaded xgrammar compile service.
- `ingress.Ingress`: the OpenAI-compatible FastAPI front end.

Nothing here holds engine logic: it places `cluster/` objects into actors and moves
msgspec bytes between them.
"""
