"""Modes -> cluster and router settings; the router command line; the progress bar."""

from __future__ import annotations

import io
import itertools

import pytest

from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.modes import DEFAULT_MODES, cluster_config_for, parse_modes
from kvrelay.bench.progress import Progress
from kvrelay.bench.runner import router_command, stats_delta
from kvrelay.cluster.config import ClusterConfig


def test_parse_modes_keeps_order_and_rejects_unknown_or_repeated():
    assert [m.name for m in parse_modes(DEFAULT_MODES)] == ["pull", "recompute", "local"]
    assert [m.name for m in parse_modes(" direct , pull")] == ["direct", "pull"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("pull,fast")
    with pytest.raises(ValueError, match="repeated"):
        parse_modes("pull,pull")
    with pytest.raises(ValueError, match="no mode"):
        parse_modes(" , ")


def test_each_mode_configures_the_engines():
    base = ClusterConfig(num_prefill=2, num_decode=2, model="bench", decoder_kv_blocks_ttl_s=60,
                         bidirectional=False, prefill_prefix_caching=True)
    modes = parse_modes("pull,recompute,local,direct")
    by_name = {m.name: cluster_config_for(m, base) for m in modes}
    assert (by_name["pull"].bidirectional, by_name["pull"].prefill_prefix_caching) == (True, False)
    assert (by_name["recompute"].bidirectional,
            by_name["recompute"].prefill_prefix_caching) == (False, False)
    assert (by_name["local"].bidirectional,
            by_name["local"].prefill_prefix_caching) == (False, True)
    assert by_name["local"].num_prefill == 1 and by_name["pull"].num_prefill == 2
    assert by_name["direct"].bidirectional
    for cfg in by_name.values():  # everything else is the user's
        assert (cfg.model, cfg.num_decode, cfg.decoder_kv_blocks_ttl_s) == ("bench", 2, 60)


def test_router_command_lists_nodes_and_enables_direct_only_for_direct():
    pull, direct = parse_modes("pull,direct")
    cmd = router_command(pull, ["http://p0", "http://p1"], ["http://d0"], host="127.0.0.1",
                         port=9000, ttl_s=60.0, python="py")
    assert cmd[:4] == ["py", "-m", "kvrelay.cli", "route"]
    pairs = list(itertools.pairwise(cmd))
    assert [v for k, v in pairs if k == "--prefill"] == ["http://p0", "http://p1"]
    assert [v for k, v in pairs if k == "--decode"] == ["http://d0"]
    assert "--direct" not in cmd
    assert cmd[cmd.index("--port") + 1] == "9000" and cmd[cmd.index("--ttl-s") + 1] == "60.0"
    assert "--direct" in router_command(direct, ["p"], ["d"], host="h", port=1, ttl_s=1.0)


def test_router_command_is_accepted_by_kvrelay_route():
    from kvrelay.cli import build_parser
    from kvrelay.router.cli import config_from_args

    (direct,) = parse_modes("direct")
    cmd = router_command(direct, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"],
                         host="127.0.0.1", port=9001, ttl_s=60.0)
    config = config_from_args(build_parser().parse_args(cmd[3:]), environ={})
    assert config.port == 9001 and config.policy.direct_enabled
    assert [n.url for n in config.prefill] == ["http://127.0.0.1:1"]
    assert config.decode[0].ttl_s == 60.0


def test_stats_delta_handles_nested_and_missing_stats():
    before = {"decisions": {"by_action": {"pull": 2}, "by_reason": {"pull": 2}}}
    after = {"decisions": {"by_action": {"pull": 5, "recompute": 1},
                           "by_reason": {"pull": 5, "no_entry": 1}}}
    assert stats_delta(before, after) == {"by_action": {"pull": 3, "recompute": 1},
                                          "by_reason": {"no_entry": 1, "pull": 3}}
    assert stats_delta(None, after) is None


def record(ok=True):
    return TurnRecord("m", "agent", "c", 1, None, 1, True, 0.0, 0.0, 1, 1,
                      0.05 if ok else None, None, 0.1, None, None, None, None,
                      None if ok else "boom")


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_prints_tenths_when_not_a_terminal():
    out = io.StringIO()
    bar = Progress("pull", 20, out, width=10)
    for _ in range(20):
        bar.update(record())
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11  # 0.05 (tenth 0), then one line per further tenth
    assert lines[-1] == "[pull] ########## 20/20 turns  ttft p50 50 ms"


def test_progress_redraws_in_place_on_a_terminal_and_counts_skips():
    out = Tty()
    bar = Progress("recompute", 5, out, width=5)
    bar.update(record())
    bar.update(record(ok=False), skipped=2)
    bar.close()
    assert out.getvalue().count("\r") == 2 and out.getvalue().endswith("\n")
    assert bar.line() == "[recompute] ####- 4/5 turns  ttft p50 50 ms  1 err"
