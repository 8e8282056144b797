"""``run_demo``: a short agent session and sweep against a running router, both reported."""

from __future__ import annotations

import io
import json

from kvrelay.bench.demo import run_demo
from tests.component.bench_stub_router import StubRouter, serve_in_thread
from tests.ports import free_port_block


def test_demo_runs_agent_sessions_and_a_sweep(tmp_path):
    stub = StubRouter()
    progress = io.StringIO()
    with serve_in_thread(stub.app(), free_port_block(1, start=22000)) as url:
        summary = run_demo(url, tmp_path / "demo", conversations=2, turns=4,
                           lengths=(1024, 2048), think_mean_s=0.0, salt="d1",
                           progress=progress)
    assert summary.errors == 0
    assert summary.agent.turns == 8 and summary.agent.hit_rate == 1.0
    assert summary.sweep.turns == 4 and set(summary.sweep.ttft_by_context) == {1024, 2048}
    assert summary.markdown.startswith("# kvrelay bench: agent")
    assert "# kvrelay bench: sweep" in summary.markdown
    assert "| 2048 | " in summary.markdown
    names = sorted(p.name for p in summary.files)
    assert names == ["agent.json", "agent.md", "agent_ttft_by_turn.png", "sweep.json",
                     "sweep.md", "sweep_ttft_by_turn.png", "sweep_ttft_vs_context.png"]
    data = json.loads((tmp_path / "demo" / "sweep.json").read_text())
    assert data["meta"]["router_url"] == url and data["meta"]["salt"] == "d1"
    ids = {r["conversation_id"] for r in data["runs"][0]["records"]}
    assert ids == {"demo-d1-sweep-1024-0", "demo-d1-sweep-2048-0"}
    assert "[pull]" in progress.getvalue()
    # the stub saw the demo's sizes: 64-token answers in the agent part
    assert {r["body"]["max_tokens"] for r in stub.requests[:8]} == {64}
