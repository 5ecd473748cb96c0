"""Processes for the tests' tensor-parallel ranks, started from one forkserver that has imported
torch and the model code: each rank forks from it instead of importing them anew, as a spawned
process does (seconds of CPU per rank, and the suite starts two dozen ranks). The forkserver
imports nothing else and starts no thread before it forks, so gloo starts clean in every rank."""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable

PRELOAD = ["torch", "cluster.model.loader", "cluster.worker.worker"]


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context (its server started with PRELOAD on first use)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def run_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn's call (fn(rank, *args) in each of nprocs processes, joined,
    a rank's exception raised here), the processes forked from the forkserver."""
    import torch.multiprocessing as mp

    context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
