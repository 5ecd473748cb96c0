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


def test_the_model_selector_filters_every_panel_and_keeps_the_models_apart():
    dash = json.loads(DASHBOARD.read_text())
    (model,) = [v for v in dash["templating"]["list"] if v["name"] == "model"]
    assert model["definition"] == "label_values(ray_llm_kv_cache_usage, model)"  # every model that has an engine
    assert model["multi"] and model["includeAll"] and model["allValue"] == ".*"
    for panel in (p for p in dash["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, selector in re.findall(r"\b(ray_[a-z0-9_]+)(\{[^}]*\})?", expr):
                wanted = 'model=~"$model"' if name.startswith("ray_llm_") else "engine:$model"
                assert wanted in selector, (panel["title"], expr)  # Serve's series: the engine deployment's name
            # Aggregations keep each model's series apart (with several models selected).
            assert not re.search(r"\b(sum|max|min|avg)\s*\(", expr), (panel["title"], expr)
            assert all("model" in by or "deployment" in by for by in re.findall(r"by \(([^)]*)\)", expr))
            assert "{{model}}" in target["legendFormat"] or "{{deployment}}" in target["legendFormat"]


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
