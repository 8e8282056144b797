"""``kvrelay bench`` end to end without vLLM: per mode, fake engines (``kvrelay fake-engine``)
and the real router (``kvrelay route``) as subprocesses, configured by the mode."""

from __future__ import annotations

import json

from kvrelay.cli import main
from tests.costs import fixed_costs_flag
from tests.ports import free_port_block


def test_sweep_pulls_in_pull_mode_and_recomputes_in_recompute_mode(tmp_path, capsys):
    out = tmp_path / "results"
    port = free_port_block(2, start=24100)
    code = main(["bench", "sweep", "--engines", "fake", "--fake-latency", "fast",
                 "--modes", "pull,recompute", "--lengths", "1024", "2048",
                 "--conversations", "1", "--gap-s", "0.3", "--base-port", str(port),
                 "--side-channel-base-port", str(port + 3000), "--salt", "fc",
                 f"--router-arg=--fixed-costs={fixed_costs_flag()}", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "sweep.json").read_text())
    pull, recompute = data["modes"]["pull"], data["modes"]["recompute"]
    assert pull["errors"] == 0 and recompute["errors"] == 0
    assert pull["hit_rate"] == 1.0 and recompute["hit_rate"] == 0.0
    assert set(pull["ttft_by_context"]) == {"1024", "2048"}
    records = {run["mode"]: run["records"] for run in data["runs"]}
    for r in records["pull"]:
        # the engines tokenize what the workload planned: prompts are on target
        assert abs(r["prompt_tokens"] - r["target_tokens"]) < 128, r
        if r["turn"] == 2:
            assert r["action"] == "pull" and r["reused_tokens"] > r["context_tokens"] - 256
    assert {r["action"] for r in records["recompute"]} == {"recompute"}
    ratios = {c["label"]: c for c in data["comparisons"]}
    assert set(ratios["recompute/pull"]["by_context"]) == {"1024", "2048"}
    assert (out / "runs" / "pull" / "router.log").exists()
    assert (out / "runs" / "recompute" / "cluster" / "fake-engine.log").exists()
    assert (out / "sweep_ttft_vs_context.png").exists()
