"""The cluster plan: cores, ports, kv-transfer config and the exact vLLM command."""

import json
from pathlib import Path

import pytest

from kvrelay.cluster.config import (
    ClusterConfig,
    assign_cores,
    kv_transfer_config,
    plan_nodes,
    router_command,
    server_command,
    server_env,
    tool_call_parser_for,
)


def test_each_node_gets_its_own_cores():
    assert assign_cores(2, [0, 1]) == [(0,), (1,)]
    assert assign_cores(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    assert assign_cores(3, [0, 1]) == [(0,), (1,), (0,)]
    with pytest.raises(ValueError):
        assign_cores(1, [])


def test_plan_orders_prefill_then_decode_with_distinct_ports():
    nodes = plan_nodes(ClusterConfig(num_prefill=2, num_decode=1, base_port=9000,
                                     side_channel_base_port=6000), [0, 1, 2])
    assert [n.name for n in nodes] == ["prefill-0", "prefill-1", "decode-0"]
    assert [n.http_port for n in nodes] == [9000, 9001, 9002]
    assert [n.side_channel_port for n in nodes] == [6000, 6001, 6002]
    assert [n.cores for n in nodes] == [(0,), (1,), (2,)]
    assert [n.prefix_caching for n in nodes] == [False, False, True]


def test_cluster_needs_both_roles():
    with pytest.raises(ValueError):
        ClusterConfig(num_prefill=0)


def test_kv_transfer_config_per_role():
    config = ClusterConfig(decoder_kv_blocks_ttl_s=60, kv_recompute_threshold=128,
                           nixl_progress_delay_us=500)
    p, d = plan_nodes(config, [0, 1])
    kp, kd = kv_transfer_config(config, p), kv_transfer_config(config, d)
    assert kp["kv_role"] == "kv_producer" and kd["kv_role"] == "kv_consumer"
    for kv in (kp, kd):
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_connector_module_path"] == "kvrelay.vllm_plugin.connector"
        assert kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        assert extra["bidirectional_kv_xfer"] is True
        assert extra["decoder_kv_blocks_ttl"] == 60
        assert extra["kv_recompute_threshold"] == 128
        assert extra["kvrelay_nixl_progress_delay_us"] == 500


def test_server_command_and_env():
    config = ClusterConfig(model="tiny", python="/py", tool_call_parser="none")
    p, d = plan_nodes(config, [0, 1])
    cmd = server_command(config, p, Path("/models/tiny-abc"))
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert "--no-enable-prefix-caching" in cmd
    assert "--enable-prefix-caching" in server_command(config, d, Path("/m"))
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer"
    env = server_env(config, d, {"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(d.side_channel_port)
    assert env["PATH"] == "/bin"


def test_local_model_dir_keeps_its_name():
    config = ClusterConfig(model="/models/my-llama", tool_call_parser="none")
    p = plan_nodes(config, [0, 1])[0]
    cmd = server_command(config, p, Path("/models/my-llama"))
    assert cmd[cmd.index("--served-model-name") + 1] == "my-llama"


def test_tool_call_parser_follows_the_model_family_unless_overridden():
    assert tool_call_parser_for("auto", "qwen3") == "hermes"
    assert tool_call_parser_for("auto", "llama") == "llama3_json"
    assert tool_call_parser_for("auto", "some_new_arch") is None
    assert tool_call_parser_for("auto", None) is None
    assert tool_call_parser_for("none", "qwen3") is None
    assert tool_call_parser_for("pythonic", "qwen3") == "pythonic"


def test_auto_tool_choice_flags_and_engine_args_per_role():
    config = ClusterConfig(tool_call_parser="hermes", engine_args=("--max-num-seqs", "8"),
                           prefill_engine_args=("--seed=1",),
                           decode_engine_args=("--enable-prefix-caching", "--seed=2"))
    p, d = plan_nodes(config, [0, 1])
    cp, cd = server_command(config, p, Path("/m")), server_command(config, d, Path("/m"))
    for cmd in (cp, cd):
        i = cmd.index("--enable-auto-tool-choice")
        assert cmd[i + 1 : i + 3] == ["--tool-call-parser", "hermes"]
    # Passed-through flags come last, so they win over kvrelay's own.
    assert cp[-3:] == ["--max-num-seqs", "8", "--seed=1"]
    assert cd[-4:] == ["--max-num-seqs", "8", "--enable-prefix-caching", "--seed=2"]
    off = server_command(ClusterConfig(tool_call_parser="none"), p, Path("/m"))
    assert "--enable-auto-tool-choice" not in off and "--tool-call-parser" not in off
    with pytest.raises(ValueError, match="resolved"):
        server_command(ClusterConfig(), p, Path("/m"))


def test_engine_arg_flags_pass_each_value_as_one_argument():
    from kvrelay.cli import build_parser
    from kvrelay.cluster.arguments import cluster_config_from_args

    json_value = '--structured-outputs-config={"disable_any_whitespace": true}'
    args = build_parser().parse_args([
        "up", "--engine-arg=--max-num-seqs=8", f"--engine-arg={json_value}",
        "--decode-engine-arg=--enable-prefix-caching", "--prefill-engine-arg=--seed",
        "--prefill-engine-arg=3", "--tool-call-parser", "none", "--max-restarts", "2"])
    config = cluster_config_from_args(args)
    assert config.engine_args == ("--max-num-seqs=8", json_value)
    assert config.prefill_engine_args == ("--seed", "3")
    assert config.decode_engine_args == ("--enable-prefix-caching",)
    assert config.tool_call_parser == "none"
    assert config.restart.max_attempts == 2


def test_default_models_are_qwen3_so_they_get_the_hermes_parser(tmp_path):
    from kvrelay.cluster.launcher import model_type_of
    from kvrelay.models import ensure_model

    path = ensure_model("tiny", tmp_path)
    assert tool_call_parser_for("auto", model_type_of(path)) == "hermes"


def test_retention_flags_reach_ds_kv_transfer_config_only():
    from kvrelay.cli import build_parser
    from kvrelay.cluster.arguments import cluster_config_from_args

    default = cluster_config_from_args(build_parser().parse_args(["up"]))
    assert (default.retention, default.retention_headroom) == ("managed", 0.0)
    p, d = plan_nodes(default, [0, 1])
    for node in (p, d):
        extra = kv_transfer_config(default, node)["kv_connector_extra_config"]
        assert "kvrelay_retention" not in extra and "kvrelay_retention_headroom" not in extra
    stock = cluster_config_from_args(build_parser().parse_args(
        ["up", "--retention", "stock", "--retention-headroom", "0.25"]))
    p, d = plan_nodes(stock, [0, 1])
    extra_d = kv_transfer_config(stock, d)["kv_connector_extra_config"]
    assert extra_d["kvrelay_retention"] == "stock"
    assert extra_d["kvrelay_retention_headroom"] == 0.25
    assert "kvrelay_retention" not in kv_transfer_config(stock, p)["kv_connector_extra_config"]


@pytest.mark.parametrize("flags", [["--retention-headroom", "1.5"],
                                   ["--retention-headroom", "most"],
                                   ["--retention", "sometimes"]])
def test_bad_retention_flags_are_refused_by_the_parser(flags, capsys):
    from kvrelay.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", *flags])
    assert exc.value.code == 2
    assert "retention" in capsys.readouterr().err


def test_the_router_is_scraped_on_its_internal_listener():
    """``kvrelay up --monitoring`` scrapes the router's internal listener (complete
    /metrics, no key), wherever its command line puts it."""
    from kvrelay.cluster.config import router_command, router_metrics_url

    def url(internal_port: int | None = None, extra: tuple[str, ...] | list[str] = ()) \
            -> str | None:
        return router_metrics_url(router_command(
            ["http://p:1"], ["http://d:2"], host="0.0.0.0", port=8000, ttl_s=60,
            internal_port=internal_port, extra=extra))

    assert url() == "http://127.0.0.1:8001"  # the router's defaults: loopback, --port + 1
    assert url(internal_port=9100) == "http://127.0.0.1:9100"
    assert url(extra=["--internal-port=9200"]) == "http://127.0.0.1:9200"
    assert url(internal_port=9100, extra=["--internal-port", "9300"]) == \
        "http://127.0.0.1:9300"  # the last one wins, as in the router's parser
    assert url(extra=["--internal-host", "10.1.2.3"]) == "http://10.1.2.3:8001"
    assert url(extra=["--internal-host", "0.0.0.0"]) == "http://127.0.0.1:8001"
    assert url(extra=["--internal-host", "::"]) == "http://[::1]:8001"
    assert url(internal_port=0) is None  # the OS's pick: unknown here


def test_a_router_in_front_of_stock_retention_learns_no_retention_times():
    """A D whose retention is stock keeps every turn its TTL whatever ``kvrelay_retain_s``
    says: a router that learned shorter times would give up entries D still holds."""
    managed = router_command(["http://p"], ["http://d"], host="h", port=1, ttl_s=480.0)
    stock = router_command(["http://p"], ["http://d"], host="h", port=1, ttl_s=480.0,
                           learned_retention=False)
    assert "--no-learned-retention" not in managed
    assert stock.count("--no-learned-retention") == 1
    assert [arg for arg in stock if arg != "--no-learned-retention"] == managed
