"""The package's one SmolLM2 `serve run` (server.py), started by the first test that asks for it
and stopped after the package's last test (scope "package"), and its engine's stats."""
import pytest

from .server import SmolServer


@pytest.fixture(scope="package")
def server(tmp_path_factory) -> SmolServer:
    srv = SmolServer(tmp_path_factory.mktemp("smollm2-apis"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="package")
def engine(server):
    """The engine replica's stats (operator endpoint)."""
    def stats() -> dict:
        r = server.get("/engine/stats", timeout=30)
        r.raise_for_status()
        return r.json()

    return stats
