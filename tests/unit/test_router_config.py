"""Router configuration: node lists, side channels, TOML, env vars and flags, in layers."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvrelay.cli import build_parser
from kvrelay.core.costs import CostLine, CostLines
from kvrelay.router.cli import config_from_args
from kvrelay.router.config import (
    DEFAULT_SESSION_HEADERS,
    ConfigError,
    RouterConfig,
    SideChannel,
    build_config,
    settings_from_env,
)

P = "http://p0:8100"
D = "http://d0:8101"


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["route", *argv])


def test_from_urls_defaults() -> None:
    cfg = RouterConfig.from_urls([P], [D, "http://d1:8102/"])
    assert [n.node_id for n in cfg.nodes] == ["prefill-0", "decode-0", "decode-1"]
    assert cfg.decode[1].url == "http://d1:8102"
    assert all(n.ttl_s == 480.0 and n.side_channel is None for n in cfg.nodes)
    # reports go to the internal listener: loopback, the public port + 1
    assert (cfg.internal_host, cfg.listen_internal_port) == ("127.0.0.1", 8001)
    assert cfg.report_url == "http://127.0.0.1:8001/internal/kv-report"
    assert cfg.policy.direct_enabled is False and cfg.report_wait_s == 1.0
    assert cfg.tenant == "default" and cfg.guard == "auto"
    assert cfg.session_headers == DEFAULT_SESSION_HEADERS
    assert {"x-session-id", "x-conversation-id"} <= set(cfg.session_headers)


def test_side_channels_by_url_or_id() -> None:
    cfg = RouterConfig.from_urls(
        [P], [D], side_channels={P: "10.0.0.1:7000", "decode-0": "[fd00::2]:7001"}
    )
    assert cfg.prefill[0].side_channel == SideChannel("10.0.0.1", 7000)
    assert cfg.decode[0].side_channel == SideChannel("fd00::2", 7001)
    assert SideChannel.parse("host") == SideChannel("host", None)
    with pytest.raises(ConfigError):
        RouterConfig.from_urls([P], [D], side_channels={"http://nope": "h"})
    with pytest.raises(ConfigError):
        SideChannel.parse("h:notaport")


@pytest.mark.parametrize(
    "layer",
    [
        {"prefill": [], "decode": [D]},
        {"prefill": ["ftp://x"], "decode": [D]},
        {"prefill": [P], "decode": [D], "unknown_knob": 1},
        {"prefill": [P], "decode": [D], "port": 0},
        {"prefill": [P], "decode": [{"url": D, "ttl_s": 5}]},  # margin 10 >= ttl
        {"prefill": [P], "decode": [{"url": D, "colour": "red"}]},
        {"prefill": [P], "decode": [D], "kv_recompute_threshold": -1},
        {"prefill": [{"url": P, "id": "x"}], "decode": [{"url": D, "id": "x"}]},
        {"prefill": [P], "decode": [D], "guard": "sometimes"},
        {"prefill": [P], "decode": [D], "port": 9000, "internal_port": 9000},
        {"prefill": [P], "decode": [D], "session_headers": 5},
        {"prefill": [P], "decode": [D], "session_headers": ["x-a", 3]},
        {"prefill": [P], "decode": [D], "max_in_flight_per_tenant": 0},
        {"prefill": [P], "decode": [D], "max_entries_per_tenant": 0},
    ],
)
def test_invalid_settings(layer: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build_config(layer)


def test_layers_toml_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(
        'host = "0.0.0.0"\nport = 9000\nttl_s = 300\nblock_size = 16\n'
        "[policy]\nkv_recompute_threshold = 32\nnear_expiry_s = 20.0\n"
        '[[prefill]]\nurl = "http://p0:8100"\nside_channel = "10.1.1.1"\n'
        '[[decode]]\nurl = "http://d0:8101"\nid = "big-d"\nttl_s = 900\nblock_size = 32\n'
    )
    args = parse(["--config", str(toml), "--port", "9100", "--direct"])
    cfg = config_from_args(args, environ={"KVRELAY_PORT": "9050", "KVRELAY_REPORT_WAIT_S": "2",
                                          "KVRELAY_PULL_COST_FACTOR": "1.5"})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 9100)  # flag beats env beats file
    assert cfg.report_wait_s == 2.0 and cfg.policy.pull_cost_factor == 1.5
    assert cfg.policy.kv_recompute_threshold == 32 and cfg.policy.near_expiry_s == 20.0
    assert cfg.policy.direct_enabled is True
    assert cfg.prefill[0].side_channel == SideChannel("10.1.1.1")
    assert cfg.prefill[0].block_size == 16
    assert (cfg.decode[0].node_id, cfg.decode[0].ttl_s, cfg.decode[0].block_size) == (
        "big-d", 900.0, 32)
    assert cfg.report_url == "http://127.0.0.1:9101/internal/kv-report"  # follows --port


def test_flags_alone() -> None:
    args = parse(["--prefill", P, "--prefill", "http://p1:8100", "--decode", D,
                  "--side-channel", f"{D}=10.0.0.9:5601", "--ttl-s", "120",
                  "--block-size", "128", "--kv-recompute-threshold", "64",
                  "--internal-url", "http://router.internal:8001", "--host", "127.0.0.1",
                  "--internal-host", "10.0.0.5", "--internal-port", "7001",
                  "--guard", "tokenize", "--session-header", "X-My-Session",
                  "--session-header", "x-other", "--max-in-flight-per-tenant", "8",
                  "--max-entries-per-tenant", "500"])
    cfg = config_from_args(args, environ={})
    assert [n.url for n in cfg.prefill] == [P, "http://p1:8100"]
    assert cfg.decode[0].side_channel == SideChannel("10.0.0.9", 5601)
    assert cfg.decode[0].ttl_s == 120.0 and cfg.decode[0].block_size == 128
    assert (cfg.internal_host, cfg.listen_internal_port) == ("10.0.0.5", 7001)
    assert cfg.report_url == "http://router.internal:8001/internal/kv-report"
    assert cfg.guard == "tokenize"
    assert cfg.session_headers == ("x-my-session", "x-other")  # replaces the defaults
    assert (cfg.tenant_in_flight, cfg.tenant_entries) == (8, 500)


def test_internal_listener_address_in_the_report_url() -> None:
    """D must reach the internal listener: a wildcard listen address is reported as
    loopback, an IPv6 host bracketed."""
    base = {"prefill": [P], "decode": [D], "port": 9000}
    assert build_config(base, {"internal_host": "0.0.0.0"}).report_url == \
        "http://127.0.0.1:9001/internal/kv-report"
    assert build_config(base, {"internal_host": "::1", "internal_port": 7000}).report_url == \
        "http://[::1]:7000/internal/kv-report"
    env = settings_from_env({"KVRELAY_GUARD": "connector", "KVRELAY_INTERNAL_PORT": "7100",
                             "KVRELAY_SESSION_HEADERS": "X-A, x-b"})
    cfg = build_config(base, env)
    assert (cfg.guard, cfg.listen_internal_port, cfg.session_headers) == (
        "connector", 7100, ("x-a", "x-b"))


def test_env_node_lists_and_bad_numbers() -> None:
    env = {"KVRELAY_PREFILL": f"{P},http://p1:1", "KVRELAY_DECODE": D, "KVRELAY_DIRECT": "yes"}
    cfg = build_config(settings_from_env(env))
    assert len(cfg.prefill) == 2 and cfg.policy.direct_enabled
    with pytest.raises(ConfigError):
        settings_from_env({"KVRELAY_TTL_S": "soon"})
    with pytest.raises(ConfigError):
        build_config({"prefill": [P], "decode": [D], "port": "eighty"})


def test_bad_side_channel_flag_and_missing_file() -> None:
    with pytest.raises(ConfigError):
        config_from_args(parse(["--prefill", P, "--decode", D, "--side-channel", "oops"]), {})
    with pytest.raises(ConfigError):
        config_from_args(parse(["--config", "/nonexistent/router.toml"]), {})


def test_route_subcommand_is_registered() -> None:
    args = parse(["--prefill", P, "--decode", D])
    assert callable(args.func)


def test_costs_learn_by_default_from_the_priors() -> None:
    cfg = RouterConfig.from_urls([P], [D])
    assert cfg.costs is None and cfg.learn_costs is True


def test_fixed_costs_flag_sets_the_lines_and_stops_learning() -> None:
    args = parse(["--prefill", P, "--decode", D, "--fixed-costs",
                  "prefill_s_per_token=1e-6, pull_s_per_token=1e-4,pull_fixed_s=0.05"])
    cfg = config_from_args(args, environ={})
    assert cfg.learn_costs is False
    assert cfg.costs == CostLines(prefill=CostLine(CostLines().prefill.fixed_s, 1e-6),
                                  pull=CostLine(0.05, 1e-4))


def test_costs_from_toml_and_env(tmp_path: Path) -> None:
    toml = tmp_path / "router.toml"
    toml.write_text(f'prefill = ["{P}"]\ndecode = ["{D}"]\nlearn_costs = false\n'
                    "[costs]\nprefill_fixed_s = 0.1\nprefill_s_per_token = 2e-4\n")
    cfg = config_from_args(parse(["--config", str(toml)]), environ={})
    assert cfg.learn_costs is False
    assert cfg.costs is not None and cfg.costs.prefill == CostLine(0.1, 2e-4)
    assert cfg.costs.pull == CostLines().pull
    env = settings_from_env({"KVRELAY_FIXED_COSTS": "pull_fixed_s=0.2"})
    cfg = build_config({"prefill": [P], "decode": [D]}, env)
    assert cfg.learn_costs is False and cfg.costs is not None
    assert cfg.costs.pull.fixed_s == 0.2
    env = settings_from_env({"KVRELAY_FIXED_COSTS": "pull_fixed_s=0.2",
                             "KVRELAY_LEARN_COSTS": "yes"})  # given costs as priors
    assert build_config({"prefill": [P], "decode": [D]}, env).learn_costs is True


@pytest.mark.parametrize("costs", [
    "prefill_s_per_token", "pull_s_per_token=fast", "pull_s_per_token=0",
    "pull_fixed_s=-1", "push_s_per_token=1e-4", {"pull_fixed_s": "x"}, {"pull_fixed_s": True},
    42,
])
def test_bad_costs_are_config_errors(costs: object) -> None:
    with pytest.raises(ConfigError, match="costs"):
        build_config({"prefill": [P], "decode": [D], "costs": costs})


def test_bad_learn_costs_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="learn_costs"):
        build_config({"prefill": [P], "decode": [D], "learn_costs": "maybe"})


NODES = {"prefill": [P], "decode": [D]}


def test_a_quoted_boolean_means_what_it_says_and_junk_is_an_error() -> None:
    """A TOML ``direct_enabled = "false"`` (a string) was truthy: the direct action turned
    on. Every boolean setting, in every layer, is read as its word or refused."""
    for value in ("false", "no", "off", "0", False):
        cfg = build_config(NODES, {"direct_enabled": value, "learned_retention": value})
        assert cfg.policy.direct_enabled is False and cfg.learned_retention is False
    cfg = build_config(NODES, {"policy": {"direct_enabled": "true"}})
    assert cfg.policy.direct_enabled is True
    for key in ("direct_enabled", "learned_retention", "learn_costs"):
        with pytest.raises(ConfigError, match=f"{key} must be true or false"):
            build_config(NODES, {key: "enabled"})
    with pytest.raises(ConfigError, match="KVRELAY_LEARNED_RETENTION must be true or false"):
        settings_from_env({"KVRELAY_LEARNED_RETENTION": "enabled"})
    with pytest.raises(ConfigError, match="KVRELAY_DIRECT must be true or false"):
        settings_from_env({"KVRELAY_DIRECT": "ture"})


@pytest.mark.parametrize(("settings", "message"), [
    ({"port": 8000.5}, "port must be an integer"),
    ({"max_in_flight": True}, "max_in_flight must be an integer"),
    ({"ttl_s": "480s"}, "ttl_s must be a number"),
    ({"ttl_s": float("inf")}, "ttl_s must be a finite number"),
    ({"pull_cost_factor": "nan"}, "pull_cost_factor must be a finite number"),
    ({"report_wait_s": float("nan")}, "report_wait_s must be a finite number"),
    ({"log_level": 5}, "log_level must be a string"),
    ({"log_level": "verbose"}, "log_level must be one of"),
    ({"side_channels": 5}, "side_channels must be a table"),
    ({"policy": {"bogus": 1}}, r"unknown policy setting\(s\) \['bogus'\]"),
    ({"policy": {"kv_recompute_threshold": "abc"}}, "kv_recompute_threshold must be an int"),
    ({"near_expiry_s": 1000.0}, "near_expiry_s .* must be below decode-0's ttl_s"),
    ({"turn_log": "/no/such/dir/turns.jsonl"}, "turn_log: no directory"),
    ({"decode": ["http://d0:8101/v1"]}, "no path"),
    ({"prefill": ["http://user@p0:8100"]}, "node URL must be"),
])
def test_a_bad_setting_is_an_error_that_names_it(settings: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(NODES, settings)


def test_an_env_variable_of_the_wrong_type_is_named() -> None:
    for name, value in (("KVRELAY_PORT", "abc"), ("KVRELAY_MAX_ENTRIES", "1e6"),
                        ("KVRELAY_REPORT_WAIT_S", "soon"), ("KVRELAY_TTL_S", "nan")):
        with pytest.raises(ConfigError, match=name):
            settings_from_env({name: value})
    assert settings_from_env({"KVRELAY_PORT": "8080"})["port"] == 8080


def test_a_port_in_use_or_a_bad_host_is_a_listen_error_not_a_traceback() -> None:
    from kvrelay.router.server import ListenError, bind

    first = bind("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ListenError, match=rf"cannot listen on 127\.0\.0\.1:{port}"):
            bind("127.0.0.1", port)
    finally:
        first.close()
    with pytest.raises(ListenError, match=r"cannot listen on 999\.1\.1\.1:"):
        bind("999.1.1.1", 0)


def test_a_node_listed_twice_or_an_empty_header_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        build_config({"prefill": [P], "decode": [D, D + "/"]})
    with pytest.raises(ConfigError, match="empty header name"):
        build_config(NODES, {"session_headers": [""]})
    assert build_config(NODES, {"session_headers": []}).session_headers == ()


@pytest.mark.parametrize(("settings", "message"), [
    ({"internal_url": "ftp://x"}, "internal_url must be http"),
    ({"internal_url": "notaurl"}, "internal_url must be http"),
    ({"report_timeout_s": 0}, "report_timeout_s must be positive"),
    ({"decode": [{"url": D, "side_channel": 5}]}, r"decode\[0\]\.side_channel must be"),
    ({"report_wait_s": 10**400}, "report_wait_s must be a number"),
])
def test_settings_that_would_leave_the_router_inert_are_refused(
        settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(NODES, settings)


@pytest.mark.parametrize("value", ["--5", "+-5", "\u00b2", "\u0663", "1_000"])
def test_an_integer_is_ascii_digits(value: str) -> None:
    with pytest.raises(ConfigError, match="KVRELAY_PORT must be an integer"):
        settings_from_env({"KVRELAY_PORT": value})


@pytest.mark.parametrize("keys", [[""], ["  "], ["", " "]])
def test_api_keys_given_but_all_empty_are_refused(keys: list[str]) -> None:
    """``--api-key "$KEY"`` with ``KEY`` unset ran the router with no keys at all, open to
    everyone (probe 14, K4), where an empty admin or metrics key, or ``TENANT:``, is
    refused. Leaving the setting out is how to run without keys."""
    argv = [a for k in keys for a in ("--api-key", k)]
    with pytest.raises(ConfigError, match="none is non-empty"):
        config_from_args(parse(["--prefill", P, "--decode", D, *argv]))
    with pytest.raises(ConfigError, match="none is non-empty"):
        build_config({"prefill": [P], "decode": [D], "api_keys": keys})
    assert config_from_args(parse(["--prefill", P, "--decode", D])).api_keys == ()


@pytest.mark.parametrize("node_id", ["decode 0/x", "d0/x", "a b", "x" * 65, "d?0", ".", ".."])
def test_a_node_id_that_is_no_path_segment_is_refused(node_id: str) -> None:
    """A node id is a path segment of ``/admin/nodes/{id}/drain``: ``decode 0/x`` was
    accepted, and draining it answered "drained" for ``decode 0`` and drained nothing
    (probe 14, K12)."""
    with pytest.raises(ConfigError, match="node id"):
        build_config({"prefill": [P], "decode": [{"url": D, "id": node_id}]})
    assert build_config({"prefill": [P], "decode": [{"url": D, "id": "gpu-node_7.d:0"}]}
                        ).decode[0].node_id == "gpu-node_7.d:0"


def test_port_65535_names_the_internal_listener() -> None:
    """The internal listener defaults to port + 1: with 65535 the error named internal_port
    as if it equalled the port (probe 14, K13)."""
    with pytest.raises(ConfigError, match="no port \\+ 1"):
        RouterConfig.from_urls([P], [D], port=65535)
    assert RouterConfig.from_urls([P], [D], port=65535, internal_port=0).port == 65535


def test_a_memory_response_store_beside_shared_state_is_warned_of(capsys: Any) -> None:
    """``--state`` means replicas; a memory response store is each one's own, so another
    replica's ``previous_response_id`` is a 400 (probe 14, K9): said at start."""
    from kvrelay.cli import main

    base = ["route", "--prefill", P, "--decode", D, "--check-config",
            "--response-store", "memory"]
    assert main([*base, "--state", "redis://127.0.0.1:1/0"]) == 0
    assert "warning: --response-store memory with --state" in capsys.readouterr().err
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "warning" not in err
    assert "note: no API keys: the router serves every client" in err  # said, not silent
    assert main([*base, "--api-key", "k1"]) == 0
    assert "no API keys" not in capsys.readouterr().err
