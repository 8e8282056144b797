"""``kvrelay tune`` end to end: a generated sample in the public format (and a CSV, and a
rotated turn log) in, the Markdown report, JSON and PNG charts out; bad input exits 2."""

from __future__ import annotations

import json

import pytest

from kvrelay.cli import main
from kvrelay.core.turnlog import TurnLogRecord
from kvrelay.router.turnlog import TurnLogWriter
from kvrelay.tune.synth import SynthSpec, synth_trace, write_trace

LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "sample.jsonl"
    write_trace(SynthSpec(conversations=150, seed=11, conversations_per_s=0.25,
                          duration_s=900), path)
    return path


def test_report_json_and_charts_from_a_public_format_sample(tmp_path, sample, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"nodes": [{"role": "prefill", "costs": {
        "prefill_s_per_token": 3e-4, "prefill_samples": 5, "transfer_s_per_token": 1e-5,
        "transfer_overhead_s": 0.02, "transfer_samples": 5}}]}))
    out = tmp_path / "out"
    code = main(["tune", str(sample), "--model-config", str(config), "--stats", str(stats),
                 "--decode", "2", "--kv-budget-gib", "8", "--ttls", "30,60,120,300,600,1200",
                 "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "tune.json").read_text())
    assert data["format"] == "chat" and data["kv_bytes_per_token"] == 131072
    assert data["costs"]["prefill_s_per_token"] == 3e-4
    assert [p["ttl_s"] for p in data["ttls"]] == [30, 60, 120, 300, 600, 1200]
    rec = data["recommendation"]
    assert rec["rule"] == "budget" and rec["budget_gib"] == 8
    fitting = [p for p in data["ttls"] if p["peak_gib"] <= 8]
    if fitting:
        assert rec["ttl_s"] == max(fitting, key=lambda p: (p["time_saved_s"], -p["ttl_s"]))[
            "ttl_s"]
    assert data["threshold_tokens"] >= 1 and data["provision"]["target_hit_rate"] == 0.9
    md = (out / "tune.md").read_text()
    assert "## Recommendation" in md and "Recompute threshold" in md
    assert "## Recommendation" in captured.out  # printed too
    for name in ("tune_hit_rate_vs_ttl.png", "tune_time_saved_vs_ttl.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in md
    if rec["ttl_s"] is not None:
        assert (out / "tune_pinned_over_time.png").exists()
        assert len(data["pinned_over_time"]["gib"]) == 2


def test_a_bigger_budget_never_recommends_a_shorter_ttl_end_to_end(tmp_path, sample):
    chosen = []
    for budget in ("0.5", "2", "8", "32", "128"):
        out = tmp_path / budget
        assert main(["tune", str(sample), "--kv-bytes-per-token", "131072", "--kv-budget-gib",
                     budget, "--out", str(out), "--no-charts", "--quiet"]) == 0
        ttl = json.loads((out / "tune.json").read_text())["recommendation"]["ttl_s"]
        chosen.append(-1 if ttl is None else ttl)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]


def test_csv_and_mooncake_inputs(tmp_path):
    records = list(synth_trace(SynthSpec(conversations=30, seed=2)))
    csv_path = tmp_path / "t.csv"
    with csv_path.open("w") as f:
        f.write("chat_id,parent_chat_id,timestamp,input_length,output_length,hash_ids\n")
        for r in records:
            ids = " ".join(map(str, r["hash_ids"]))
            f.write(f"{r['chat_id']},{r['parent_chat_id']},{r['timestamp']},"
                    f"{r['input_length']},{r['output_length']},{ids}\n")
    moon = tmp_path / "moon.jsonl"
    moon.write_text("".join(json.dumps({
        "timestamp": int(r["timestamp"] * 1000), "input_length": r["input_length"],
        "output_length": r["output_length"], "hash_ids": r["hash_ids"]}) + "\n" for r in records))
    results = {}
    for name, path, extra in (("csv", csv_path, []), ("moon", moon, ["--block-tokens", "16"])):
        out = tmp_path / name
        assert main(["tune", str(path), "--kv-bytes-per-token", "1000", "--out", str(out),
                     "--no-charts", "--quiet", *extra]) == 0
        results[name] = json.loads((out / "tune.json").read_text())
    assert results["csv"]["conversations"] == 30
    # the sessions inferred from block hashes are the real ones
    assert results["moon"]["conversations"] == 30
    def outcome(data):
        return [(p["hits"], p["pulls"], p["tokens_reused"]) for p in data["ttls"]]

    assert outcome(results["moon"]) == outcome(results["csv"])


def test_rotated_turn_logs(tmp_path):
    log = tmp_path / "turns.jsonl"
    writer = TurnLogWriter(log, max_bytes=2000, backups=5, buffer_bytes=1)
    at = 1_700_000_000.0
    for conv in range(6):
        for k in range(3):
            writer.append(TurnLogRecord(
                key=f"c{conv}", at_s=at + conv * 10 + k * 40, gap_s=None if k == 0 else 39.0,
                prompt_tokens=1000 * (k + 1), reused_tokens=0, new_tokens=1000 * (k + 1),
                output_tokens=100, action="recompute", reason="no_entry",
                decode_node=f"decode-{conv % 2}", retained_tokens=1000 * (k + 1) + 99,
                duration_s=1.0))
    writer.close()
    files = sorted(tmp_path.glob("turns.jsonl*"), key=lambda p: p.name, reverse=True)
    assert len(files) > 2
    out = tmp_path / "out"
    assert main(["tune", *map(str, files), "--kv-bytes-per-token", "1000", "--ttls", "30,70",
                 "--out", str(out), "--no-charts", "--quiet"]) == 0
    data = json.loads((out / "tune.json").read_text())
    assert (data["format"], data["turns"], data["conversations"]) == ("turnlog", 18, 6)
    by_ttl = {p["ttl_s"]: p for p in data["ttls"]}
    assert by_ttl[30]["hits"] == 0 and by_ttl[70]["hits"] == 12  # gaps 39 s, margin 25 s
    assert [d["node"] for d in by_ttl[70]["decode"]] == ["decode-0", "decode-1"]


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --model-config and --kv-bytes-per-token"),
    (["--kv-bytes-per-token", "1", "--model-config", "x"], "exactly one"),
    (["--kv-bytes-per-token", "1", "--ttls", "60,abc"], "--ttls"),
    (["--kv-bytes-per-token", "1", "--kv-budget-gib", "-1"], "budget"),
])
def test_bad_arguments_exit_2(tmp_path, sample, capsys, argv, message):
    assert main(["tune", str(sample), "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_unreadable_trace_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chat_id": 1}\n')
    assert main(["tune", str(bad), "--kv-bytes-per-token", "1", "--out", str(tmp_path)]) == 2
    assert "line 1" in capsys.readouterr().err


def test_a_trace_without_follow_ups_gets_no_ttl(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 5, "input_length": 100,'
                    ' "output_length": 10}\n')
    out = tmp_path / "out"
    assert main(["tune", str(path), "--kv-bytes-per-token", "1", "--out", str(out),
                 "--quiet"]) == 0
    data = json.loads((out / "tune.json").read_text())
    assert data["followups"] == 0 and data["recommendation"]["ttl_s"] is None
    md = (out / "tune.md").read_text()
    assert "TTL: no recommendation" in md and "the input has no follow-ups" in md
    assert not (out / "tune_pinned_over_time.png").exists()
