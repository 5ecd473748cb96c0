"""Ray tests: loopback only, bounded CPUs, every process stopped by pid at the end."""
from pathlib import Path

import pytest

from actors.env import apply_loopback_env

# Before anything imports ray: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import time,
# and without it a local node advertises the external interface even with 127.0.0.1 asked.
apply_loopback_env()


@pytest.fixture(scope="module")
def local_ray():
    """An in-process local Ray on 127.0.0.1 with a few logical CPUs; shut down after the module."""
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the env was set
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             namespace="tests", log_to_driver=False)
    yield ray
    ray.shutdown()


# Modules whose tests compute hard in this process with two torch threads (lm-eval's hf backend,
# an HF reference): run last, when the suite's other half has ended and no longer takes a core
# from their threads (test_lm_eval took 107 s there, 33-42 s alone).
LAST = ("test_lm_eval.py",)


def pytest_collection_modifyitems(config, items):
    """Every test of this folder starts a cluster (marker `cluster`) unless its module is marked
    `no_cluster` (its packages' modules too: tiny_apps/, smollm2_apis/): tests/run_suite.py runs the cluster
    ones in one process, one module after the other (two local Rays on one host share ports Ray
    fixes), and the rest beside them. The modules in LAST go to the end (a stable sort: the rest
    keep their order)."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and not item.get_closest_marker("no_cluster"):
            item.add_marker(pytest.mark.cluster)
    items.sort(key=lambda item: item.path.is_relative_to(here) and item.path.name in LAST)
