"""actors/serve_cli.py without a cluster: the local Ray start is tried again when its node
does not register in time (the 30 s Ray allows can pass on a busy 2-core machine), with the
half-started processes stopped first; any other failure is not retried."""
import subprocess

import pytest
import ray

from actors import serve_cli

STARTUP_TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


def test_a_node_that_does_not_register_is_started_again_with_its_processes_stopped(monkeypatch):
    calls, leftovers = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:  # what a half-started node leaves: a child process of ours
            leftovers.append(subprocess.Popen(["sleep", "600"]))
            raise STARTUP_TIMEOUT
        return "context"

    monkeypatch.setattr(ray, "init", init)
    assert serve_cli._start_local_ray(9999) == "context"
    assert len(calls) == 2 and calls[1]["_node_ip_address"] == "127.0.0.1" and calls[1]["_metrics_export_port"] == 9999
    assert leftovers[0].wait(5) is not None  # stopped before the second attempt


def test_it_gives_up_after_its_attempts_and_never_retries_other_errors(monkeypatch):
    calls = []

    def timing_out(**kwargs):
        calls.append(1)
        raise STARTUP_TIMEOUT

    monkeypatch.setattr(ray, "init", timing_out)
    with pytest.raises(Exception, match="timed out during startup"):
        serve_cli._start_local_ray(9999)
    assert len(calls) == serve_cli.RAY_START_ATTEMPTS

    def refusing(**kwargs):
        calls.append(1)
        raise ValueError("bad argument")

    calls.clear()
    monkeypatch.setattr(ray, "init", refusing)
    with pytest.raises(ValueError, match="bad argument"):
        serve_cli._start_local_ray(9999)
    assert len(calls) == 1
