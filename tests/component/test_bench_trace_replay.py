"""``kvrelay bench replay --trace`` end to end: a small trace whose gaps sit far from every TTL
boundary, replayed time-scaled through the real router on fake engines at two TTLs; the
measured hit rate must equal tune's prediction exactly."""

from __future__ import annotations

import json

from kvrelay.cli import main


def trace_rows():
    rows, chat = [], 0
    # per conversation: start, then gaps (trace seconds) before each follow-up
    plans = [(0, [5, 100]), (2, [600]), (4, [5, 5, 600]), (6, [100, 5]), (8, [600, 100])]
    for start, gaps in plans:
        t, parent, prompt = float(start), -1, 300
        for k in range(len(gaps) + 1):
            rows.append({"chat_id": chat, "parent_chat_id": parent, "timestamp": t,
                         "input_length": prompt, "output_length": 20, "turn": k + 1,
                         "type": "text"})
            parent, chat = chat, chat + 1
            prompt += 20 + 40
            if k < len(gaps):
                t += gaps[k]
    return sorted(rows, key=lambda r: r["timestamp"])


def test_measured_hit_rate_equals_the_prediction(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in trace_rows()))
    out = tmp_path / "out"
    code = main(["bench", "replay", "--trace", str(trace), "--time-scale", "100",
                 "--ttls", "60,300", "--engines", "fake", "--fake-latency", "fast",
                 "--salt", "tr", "--out", str(out), "--no-charts"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads((out / "trace_vs_tune.json").read_text())["ttls"]
    by_ttl = {r["ttl_s"]: r for r in rows}
    # 10 follow-ups: 4 gaps of 5 s hit at both TTLs, 3 of 100 s only at 300 s, 3 of 600 s never
    assert by_ttl[60]["followups"] == by_ttl[300]["followups"] == 10
    assert by_ttl[60]["predicted_pull_rate"] == 4 / 10
    assert by_ttl[300]["predicted_pull_rate"] == 7 / 10
    for r in rows:
        assert r["failed_turns"] == 0
        assert r["measured_hit_rate"] == r["predicted_pull_rate"]
        assert r["measured_decode_tokens"] > 0
    assert "Replay vs `kvrelay tune`" in (out / "trace.md").read_text()
    assert (out / "runs" / "ttl-60s" / "router.log").exists()
