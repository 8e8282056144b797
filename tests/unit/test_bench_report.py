"""Report files: JSON content, Markdown tables with ratios, PNG charts that decode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib import image as mpimg

from kvrelay.bench.charts import wide_span
from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.report import (
    SEED_REFERENCE,
    BenchResults,
    ModeRun,
    load_results,
    markdown_report,
    write_report,
)

FOLLOWUP_MS = {"pull": (120, 460), "recompute": (160, 780), "local": (100, 300)}


def sweep_records(mode):
    out = []
    for i, (ctx, ms) in enumerate(zip((2048, 24576), FOLLOWUP_MS[mode], strict=True)):
        conv = f"{mode}-c{i}"
        pulled = mode == "pull"
        out.append(TurnRecord(mode, "sweep", conv, 1, ctx, ctx - 100, False, 0.0, 0.0, ctx - 100,
                              32, 2.0, 0.01, 2.5, "recompute", "no_entry", 0, "headers", None))
        out.append(TurnRecord(mode, "sweep", conv, 2, ctx, ctx, True, 1.0, 3.0, ctx, 16,
                              ms / 1000, 0.01, 1.0, "pull" if pulled else "recompute",
                              "pull" if pulled else "no_entry", ctx - 90 if pulled else 0,
                              "headers", None))
    return out


@pytest.fixture
def results():
    runs = [ModeRun(m, sweep_records(m), {"bidirectional": m == "pull"})
            for m in ("pull", "recompute", "local")]
    return BenchResults("sweep", {"lengths": [2048, 24576]}, runs,
                        {"model": "tiny", "salt": "abc", "started": "now"})


def test_json_holds_summaries_comparisons_and_records(results, tmp_path):
    files = write_report(results, tmp_path)
    data = json.loads(files.json.read_text())
    assert files.json == tmp_path / "sweep.json"
    assert set(data["modes"]) == {"pull", "recompute", "local"}
    pull = data["modes"]["pull"]
    assert pull["hit_rate"] == 1.0 and data["modes"]["recompute"]["hit_rate"] == 0.0
    assert pull["ttft_by_context"]["24576"]["p50"] == pytest.approx(0.46)
    ratios = {c["label"]: c for c in data["comparisons"]}
    assert ratios["recompute/pull"]["by_context"]["2048"] == pytest.approx(160 / 120)
    assert ratios["pull/local"]["by_context"]["24576"] == pytest.approx(460 / 300)
    assert len(data["runs"][0]["records"]) == 4
    assert data["runs"][0]["info"] == {"bidirectional": True}
    again = load_results(files.json)
    assert again.runs[1].records == results.runs[1].records
    assert again.summaries() == results.summaries()


def test_markdown_has_mode_context_turn_and_decision_tables(results):
    md = markdown_report(results)
    assert md.startswith("# kvrelay bench: sweep")
    assert "model tiny" in md and "salt abc" in md
    row = next(line for line in md.splitlines() if line.startswith("| pull |"))
    assert "100%" in row
    header = next(line for line in md.splitlines() if line.startswith("| context |"))
    assert header == "| context | pull | recompute | local | recompute/pull | pull/local |"
    assert "| 24576 | 460.0 | 780.0 | 300.0 | 1.70x | 1.53x |" in md
    assert "| 2 | 290.0 | 470.0 | 200.0 |" in md  # mean TTFT of turn 2 per mode
    assert "| recompute | recompute 4 | no_entry 4 | 2 | 0% |" in md
    assert SEED_REFERENCE in md


def test_charts_are_valid_pngs(results, tmp_path):
    files = write_report(results, tmp_path)
    names = sorted(p.name for p in files.charts)
    assert names == ["sweep_ttft_by_turn.png", "sweep_ttft_vs_context.png"]
    for path in files.charts:
        raw = path.read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = mpimg.imread(path)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300
        assert float(np.std(pixels)) > 0.01  # something was drawn


def test_context_chart_goes_log_scale_only_for_a_wide_span():
    assert wide_span([0.1, 2.5]) is True  # recompute 25x above pull
    assert wide_span([0.1, 1.9]) is False
    assert wide_span([]) is False and wide_span([0.0, 1.0]) is False


def test_no_context_no_context_chart_and_no_charts_flag(tmp_path):
    rec = TurnRecord("x", "agent", "c", 1, None, 10, True, 0.0, 0.0, 10, 5, 0.1, None, 0.2,
                     None, None, None, None, None)
    results = BenchResults("agent", {}, [ModeRun("x", [rec])])
    files = write_report(results, tmp_path)
    assert [p.name for p in files.charts] == ["agent_ttft_by_turn.png"]
    assert "TTFT by context length" not in files.markdown.read_text()
    none = write_report(results, tmp_path / "nocharts", charts=False)
    assert none.charts == () and none.markdown.exists()


def test_failed_mode_still_reports(tmp_path):
    rec = TurnRecord("x", "agent", "c", 1, None, 10, True, 0.0, 0.0, None, 0, None, None, 0.2,
                     None, None, None, None, "HTTP 500: nope")
    files = write_report(BenchResults("agent", {}, [ModeRun("x", [rec])]), tmp_path)
    md = files.markdown.read_text()
    assert "| x | 1 | 1 | - |" in md
    assert json.loads(files.json.read_text())["modes"]["x"]["ttft"] is None
