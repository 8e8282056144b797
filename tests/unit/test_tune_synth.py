"""Synthetic traces: deterministic, in the public chat format, append-only histories with
matching block hashes, gaps drawn from the stated mixture, and a recording window. On such a
trace with known gaps, tune's predicted hit rate is the mixture's CDF at TTL - margin."""

from __future__ import annotations

import json
import math
import random

import pytest

from kvrelay.tune.model import ModelParams, RetentionModel
from kvrelay.tune.retention import RetentionBuilder
from kvrelay.tune.synth import GapMixture, LogNormalPause, SynthSpec, synth_trace, write_trace
from kvrelay.tune.trace import read_turns, turns_from_records


def test_same_seed_same_trace_other_seed_another(tmp_path):
    spec = SynthSpec(conversations=20, seed=4)
    write_trace(spec, tmp_path / "a.jsonl")
    write_trace(spec, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert list(synth_trace(SynthSpec(conversations=20, seed=5))) != list(synth_trace(spec))


def test_records_are_in_the_public_format_and_time_order():
    records = list(synth_trace(SynthSpec(conversations=50, seed=1)))
    assert set(records[0]) == {"chat_id", "parent_chat_id", "timestamp", "input_length",
                               "output_length", "turn", "type", "hash_ids"}
    stamps = [r["timestamp"] for r in records]
    assert stamps == sorted(stamps)
    assert [r["chat_id"] for r in records] == list(range(len(records)))
    by_id = {r["chat_id"]: r for r in records}
    for r in records:
        assert math.ceil(r["input_length"] / 16) == len(r["hash_ids"])
        if r["parent_chat_id"] == -1:
            assert r["turn"] == 1
            continue
        parent = by_id[r["parent_chat_id"]]
        assert r["turn"] == parent["turn"] + 1
        # the history (parent prompt + answer) is a prefix: every full parent block matches
        full = parent["input_length"] // 16
        assert r["hash_ids"][:full] == parent["hash_ids"][:full]
        assert r["input_length"] > parent["input_length"] + parent["output_length"]


def test_gaps_follow_the_mixture():
    mix = GapMixture(0.6, LogNormalPause(0.5, 10.0), LogNormalPause(60.0, 900.0))
    rng = random.Random(1)
    gaps = sorted(mix.sample(rng) for _ in range(20000))
    for x in (0.5, 5.0, 60.0, 600.0):
        empirical = sum(g <= x for g in gaps) / len(gaps)
        assert empirical == pytest.approx(mix.cdf(x), abs=0.015)
    assert mix.scaled(2).cdf(20.0) == pytest.approx(mix.cdf(10.0))


def test_the_window_keeps_only_earlier_turns():
    records = list(synth_trace(SynthSpec(conversations=200, seed=2, duration_s=120)))
    assert records and max(r["timestamp"] for r in records) < 120


def test_predicted_hit_rate_matches_the_known_gap_distribution(tmp_path):
    spec = SynthSpec(conversations=3000, seed=9, turns_mean=4)
    path = tmp_path / "t.jsonl"
    write_trace(spec, path)
    b = RetentionBuilder().add_all(read_turns(path))
    model = RetentionModel(b.finish(), ModelParams(kv_bytes_per_token=1.0))
    followups = model.followups
    for ttl in (60.0, 300.0, 1200.0):
        expected = spec.gaps.cdf(ttl - 25.0)
        sampling = 3 * math.sqrt(expected * (1 - expected) / followups)
        assert model.at(ttl).hit_rate == pytest.approx(expected, abs=sampling + 0.002)


def test_records_convert_to_turns_with_sessions():
    turns = list(turns_from_records(synth_trace(SynthSpec(conversations=5, seed=3))))
    assert len({t.conversation for t in turns}) == 5


def test_bad_specs():
    with pytest.raises(ValueError):
        SynthSpec(conversations=0)
    with pytest.raises(ValueError):
        LogNormalPause(5.0, 1.0)
    with pytest.raises(ValueError):
        GapMixture(tool_fraction=1.5)


def test_cli_writes_the_trace(tmp_path, capsys):
    from kvrelay.cli import main

    out = tmp_path / "t.jsonl"
    assert main(["tune-synth", "--conversations", "7", "--seed", "3", "--gap-scale", "2",
                 "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines and all(json.loads(x)["type"] == "text" for x in lines)
    assert main(["tune-synth", "--conversations", "7", "--gap-scale", "-1",
                 "--out", str(out)]) == 2
