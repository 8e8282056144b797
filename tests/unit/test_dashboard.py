"""The dashboard table and what is built from it: the Grafana JSON (committed copy in sync),
the Prometheus scrape config, and legends. That every query returns data is checked against
a real Prometheus in tests/component/test_monitoring_prometheus.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvrelay.deploy import panels
from kvrelay.deploy.dashboard_png import legend
from kvrelay.deploy.grafana import dashboard, dashboard_text
from kvrelay.deploy.prometheus import ScrapeTarget, scrape_config

COMMITTED = Path(__file__).parents[2] / "docs" / "grafana" / "kvrelay.json"
METRIC = re.compile(r"\b(kvrelay_router_\w+|vllm:\w+)")


def test_committed_dashboard_is_the_generated_one():
    assert COMMITTED.read_text() == dashboard_text(), (
        "regenerate: kvrelay deploy dashboard -o docs/grafana/kvrelay.json")


def test_metric_names_come_only_from_the_constants():
    """A rename is one line: no query spells a metric name of its own."""
    names = {v for k, v in vars(panels).items() if k.isupper() and isinstance(v, str)
             and (v.startswith("kvrelay_") or v.startswith("vllm:"))}
    for _, query in panels.all_queries():
        used = {m.removesuffix("_bucket") for m in METRIC.findall(query.expr)}
        assert used and used <= names, query.expr


def test_dashboard_covers_what_operators_need():
    titles = [p.title for p in panels.PANELS]
    for needed in ("Turns by action", "Turns by reason", "Reuse rate", "TTFT by action",
                   "Retained KV per D", "Node health", "Upstream errors", "Redis errors",
                   "P and D prompt tokens by source", "KV cache usage"):
        assert needed in titles


def test_grafana_model_is_well_formed():
    model = dashboard()
    ids = [p["id"] for p in model["panels"]]
    assert len(set(ids)) == len(ids) == len(panels.PANELS)
    cells = set()
    for panel, spec in zip(model["panels"], panels.PANELS, strict=True):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        cell = (grid["x"], grid["y"])
        assert cell not in cells
        cells.add(cell)
        assert [t["expr"] for t in panel["targets"]] == [q.expr for q in spec.queries]
        assert len({t["refId"] for t in panel["targets"]}) == len(spec.queries)
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert model["templating"]["list"][0]["type"] == "datasource"
    json.dumps(model)


def test_scrape_config_labels_every_target_with_its_component():
    config = yaml.safe_load(scrape_config([
        ScrapeTarget("router", "http://127.0.0.1:8000"),
        ScrapeTarget("prefill", "http://127.0.0.1:8100"),
        ScrapeTarget("decode", "http://127.0.0.1:8101"),
        ScrapeTarget("decode", "http://127.0.0.1:8102"),
    ], interval_s=5))
    assert config["global"]["scrape_interval"] == "5s"
    jobs = {j["job_name"]: j["static_configs"][0] for j in config["scrape_configs"]}
    assert jobs["kvrelay-decode"] == {"targets": ["127.0.0.1:8101", "127.0.0.1:8102"],
                                      "labels": {"component": "decode"}}
    assert set(jobs) == {"kvrelay-router", "kvrelay-prefill", "kvrelay-decode"}


def test_legend_fills_labels_like_grafana():
    assert legend("{{action}} {{reason}}", {"action": "pull", "reason": "pull"}) == "pull pull"
    assert legend("p50 {{ action }}", {"action": "recompute"}) == "p50 recompute"
    assert legend("{{node}}", {}) == ""


def test_rate_window_is_replaced_for_plain_prometheus():
    query = panels.PANELS[0].queries[0]
    assert "$__rate_interval" in query.expr
    assert "[1m]" in query.for_prometheus("1m") and "$__" not in query.for_prometheus("1m")
