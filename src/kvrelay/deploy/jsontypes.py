"""JSON documents (Kubernetes manifests, Grafana dashboards) as typed values."""

from __future__ import annotations

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
Manifest = dict[str, JsonValue]
