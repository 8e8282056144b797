"""A Prometheus for a local kvrelay cluster: scrape config, server process, query client.

``kvrelay up --monitoring`` writes ``scrape_config`` for its router, P and D to the run
directory and starts Debian's ``prometheus`` on it (``prometheus_service``). Every target
gets a ``component`` label (``router``, ``prefill``, ``decode``), which the dashboard's
queries use (``kvrelay.deploy.panels``). ``PrometheusClient`` reads instant and range
queries back (tests, ``kvrelay deploy dashboard-png``).
"""

from __future__ import annotations

import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvrelay.cluster.launcher import ServiceProcess

PROMETHEUS_PACKAGE = "prometheus"


@dataclass(frozen=True)
class ScrapeTarget:
    """One ``/metrics`` endpoint: ``component`` is router, prefill or decode."""

    component: str
    url: str

    @property
    def address(self) -> str:
        parts = urllib.parse.urlsplit(self.url)
        return parts.netloc


def scrape_config(targets: list[ScrapeTarget], interval_s: float = 5.0,
                  router_key_file: Path | None = None) -> str:
    """``prometheus.yml`` scraping ``targets``, one job per component. A router target is
    its internal listener (complete ``/metrics``, no key) or its public URL; with
    ``router_key_file`` the router job sends the key in that file as a bearer token, for a
    public ``/metrics`` locked with ``--metrics-key`` (docs/security.md)."""
    import yaml

    components = sorted({t.component for t in targets})
    jobs: list[dict[str, object]] = []
    for component in components:
        job: dict[str, object] = {
            "job_name": f"kvrelay-{component}",
            "metrics_path": "/metrics",
            "static_configs": [{
                "targets": [t.address for t in targets if t.component == component],
                "labels": {"component": component},
            }],
        }
        if component == "router" and router_key_file is not None:
            job["authorization"] = {"type": "Bearer",
                                    "credentials_file": str(router_key_file)}
        jobs.append(job)
    config = {
        "global": {"scrape_interval": _duration(interval_s),
                   "evaluation_interval": _duration(interval_s)},
        "scrape_configs": jobs,
    }
    return str(yaml.safe_dump(config, sort_keys=False))


def find_prometheus() -> str | None:
    """The ``prometheus`` binary (Debian package ``prometheus``), if installed."""
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None


def prometheus_service(binary: str, targets: list[ScrapeTarget], run_dir: Path, host: str,
                       port: int, interval_s: float = 5.0) -> ServiceProcess:
    """A (not yet started) Prometheus scraping ``targets``, its files under ``run_dir``."""
    config_path = run_dir / "prometheus.yml"
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path.write_text(scrape_config(targets, interval_s))
    url = f"http://{host}:{port}"
    cmd = [binary, f"--config.file={config_path}",
           f"--storage.tsdb.path={run_dir / 'prometheus-data'}",
           f"--web.listen-address={host}:{port}", "--storage.tsdb.retention.time=2d"]
    return ServiceProcess("prometheus", cmd, [f"{url}/-/ready"], run_dir / "prometheus.log",
                          url=url)


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class RangeSeries:
    labels: dict[str, str]
    points: list[tuple[float, float]]


class PrometheusError(RuntimeError):
    """Prometheus refused a query (bad PromQL) or could not be reached."""


class PrometheusClient:
    """Instant and range queries over Prometheus's HTTP API."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self._url = url.rstrip("/")
        self._timeout_s = timeout_s

    def query(self, expr: str) -> list[Sample]:
        data = self._get("/api/v1/query", {"query": expr})
        if data.get("resultType") != "vector":
            raise PrometheusError(f"{expr}: expected a vector, got {data.get('resultType')}")
        return [Sample(_labels(s), float(s["value"][1])) for s in data["result"]]

    def query_range(self, expr: str, start_s: float, end_s: float,
                    step_s: float) -> list[RangeSeries]:
        data = self._get("/api/v1/query_range", {
            "query": expr, "start": f"{start_s:.3f}", "end": f"{end_s:.3f}",
            "step": f"{step_s:g}"})
        return [RangeSeries(_labels(s), [(float(t), float(v)) for t, v in s["values"]])
                for s in data["result"]]

    def _get(self, path: str, params: dict[str, str]) -> Any:
        """The ``data`` of a successful answer (parsed JSON, read only in this class)."""
        try:
            resp = httpx.get(self._url + path, params=params, timeout=self._timeout_s)
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise PrometheusError(f"{self._url}{path}: {exc}") from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{params.get('query')}: {body.get('error', resp.text)}")
        return body["data"]


def _labels(series: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in series.get("metric", {}).items()}


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms" if seconds < 1 else f"{int(seconds)}s"
