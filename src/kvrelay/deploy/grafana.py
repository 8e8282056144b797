"""The Grafana dashboard (JSON model) built from ``kvrelay.deploy.panels.PANELS``.

Plain JSON rather than a dashboard SDK: the model is a handful of time-series panels, and
writing it here keeps the dependency list short and the output stable (the committed
``docs/grafana/kvrelay.json`` is compared with it by the tests). It is provisionable as is
(docs/monitoring.md): the Prometheus data source is a dashboard variable, so any Grafana
picks its own.
"""

from __future__ import annotations

import json

from kvrelay.deploy.jsontypes import JsonValue, Manifest
from kvrelay.deploy.panels import PANELS, Panel

DASHBOARD_UID = "kvrelay-router"
_DATASOURCE: Manifest = {"type": "prometheus", "uid": "${datasource}"}
_COLUMNS = 2
_WIDTH = 24 // _COLUMNS
_HEIGHT = 8


def dashboard(panels: tuple[Panel, ...] = PANELS) -> Manifest:
    """The dashboard's JSON model."""
    return {
        "uid": DASHBOARD_UID,
        "title": "kvrelay",
        "description": "KV-cache-aware routing on P/D disaggregated vLLM: decisions, reuse, "
                       "TTFT, retained KV, health, errors, and P/D's own vLLM metrics.",
        "tags": ["kvrelay", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }]},
        "panels": [_panel(i, p) for i, p in enumerate(panels)],
    }


def dashboard_text(panels: tuple[Panel, ...] = PANELS) -> str:
    return json.dumps(dashboard(panels), indent=2) + "\n"


def _panel(index: int, panel: Panel) -> JsonValue:
    row, column = divmod(index, _COLUMNS)
    targets: list[JsonValue] = [
        {"refId": chr(ord("A") + i), "datasource": _DATASOURCE, "expr": q.expr,
         "legendFormat": q.legend, "range": True}
        for i, q in enumerate(panel.queries)
    ]
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _DATASOURCE,
        "gridPos": {"x": column * _WIDTH, "y": row * _HEIGHT, "w": _WIDTH, "h": _HEIGHT},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": targets,
    }
