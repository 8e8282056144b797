"""`kvrelay bench`'s real-cluster path: the demo workload (agent sessions and a small sweep)
against the router in front of the real local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.bench.demo import run_demo
from tests.e2e.conftest import RealCluster

pytestmark = pytest.mark.e2e


def test_demo_workload_on_the_real_cluster(real_cluster: RealCluster, tmp_path: Path):
    summary = run_demo(real_cluster.router_url, tmp_path, model="tiny",
                       served_model_name=real_cluster.model, conversations=2, turns=3,
                       lengths=(512, 1024), think_mean_s=0.0, charts=True)
    assert summary.errors == 0
    assert summary.agent.turns == 6 and summary.sweep.turns == 4
    assert summary.agent.hit_rate == 1.0, summary.agent.reasons
    assert summary.sweep.hit_rate == 1.0, summary.sweep.reasons
    written = {p.name for p in summary.files}
    assert {"agent.json", "agent.md", "sweep.json", "sweep.md"} <= written
    assert all(p.stat().st_size > 0 for p in summary.files)
