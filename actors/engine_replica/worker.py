"""`worker-<rank>`: one tensor-parallel rank of `cluster.worker.Worker` inside a Ray actor.

The actor starts empty so that rank 0 can pick the rendezvous address on its own node
before any rank blocks in `init_process_group` (all ranks must initialize concurrently).

`ping` runs on a thread of its own (the `health` concurrency group), so a worker answers it in the
middle of a long step: the engine replica tells a busy worker from a frozen or lost one
(actors/engine_replica/deployment.py). `execute` stays in the default group, one thread, so the plans
still run in the order the engine submitted them.

`execute` runs once per engine step, so it records no Ray task events: the GCS keeps every
recorded event (up to 100k by default, ~3 KB each: the soak measured +220 MB/h on the GCS) and
the dashboard's task list would be nothing but steps. The engine's own metrics count steps.
"""
from __future__ import annotations

import socket

import ray


@ray.remote(concurrency_groups={"health": 1})
class WorkerActor:
    def __init__(self) -> None:
        self.worker = None
        self.rank = -1

    def rendezvous_address(self) -> str:
        """A free TCP port on this node for torch.distributed's tcp:// init."""
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def init(self, config, rank: int, world_size: int, init_method: str | None,
             torch_threads: int | None) -> int:
        """Build this rank's worker from a finalized EngineConfig; returns its KV block count."""
        import torch

        from cluster.worker.worker import Worker

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.rank = rank
        self.worker = Worker(config, rank, world_size, init_method)
        return self.worker.num_kv_blocks

    @ray.method(enable_task_events=False)
    def execute(self, plan_bytes: bytes) -> bytes | None:
        return self.worker.execute(plan_bytes)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        if self.worker is None:
            raise RuntimeError("worker not initialized")
        return self.rank
