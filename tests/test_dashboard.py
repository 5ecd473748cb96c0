"""The Grafana dashboard and docs/metrics.md cover exactly the metrics the code records."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "llm-cluster-grafana.json"


def _recorded() -> set[str]:
    """Every `llm_*` metric name actors/metrics.py registers (as Ray exports it: `ray_` prefix)."""
    source = (ROOT / "actors" / "metrics.py").read_text()
    return {f"ray_{name}" for name in re.findall(r'"(llm_[a-z0-9_]+)"', source)}


def _base(series: str) -> str:
    return re.sub(r"_(total|bucket|sum|count)$", "", series)


def test_every_panel_queries_recorded_metrics_and_every_metric_has_a_panel():
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    used = set()
    for panel in panels:
        assert panel["description"] and panel["datasource"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bray_llm_[a-z0-9_]+", target["expr"]))
            assert {_base(n) for n in names} <= _recorded(), (panel["title"], names)
            used |= {_base(n) for n in names}
    # The since-start hit-rate gauge is charted as a windowed rate of its two counters instead.
    assert used == _recorded() - {"ray_llm_prefix_cache_hit_rate"}
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model"}


def test_metrics_doc_names_every_metric_and_the_dashboard():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    exported = {name: f"{name}_total" if name in _counters() else name for name in _recorded()}
    missing = [shown for shown in exported.values() if shown not in doc]
    assert not missing
    assert "dashboards/llm-cluster-grafana.json" in doc
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["type"] == "row" or panel["title"] in doc, panel["title"]


def _counters() -> set[str]:
    source = (ROOT / "actors" / "metrics.py").read_text()
    counters = set(re.findall(r'Counter\(\s*"(llm_[a-z0-9_]+)"', source))
    counters |= set(re.findall(r'\("(llm_[a-z0-9_]+)", "[^"]*"\)', source))  # the _COUNTERS table
    return {f"ray_{c}" for c in counters}
