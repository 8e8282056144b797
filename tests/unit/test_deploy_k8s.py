"""``kvrelay deploy k8s``: the rendered manifests validate offline against the Kubernetes API
schemas (kubernetes-validate's bundled ones, strict: unknown fields are errors), and hang
together: Services, PDBs and the ServiceMonitor select what exists, probes name real ports,
the router addresses every P and D pod, and every engine and router command line parses
with vLLM's and kvrelay's own argument parsers."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvrelay.cli import build_parser, main
from kvrelay.deploy.config import DeployConfig, DeployConfigError, from_settings

K8S_VERSION = "1.30"
#: Flags the router gains with its internal report listener (docs/deploy.md); until it has
#: them, they are the only arguments its parser may not know.
INTERNAL_LISTENER_FLAGS = ("--internal-host", "--internal-port", "--internal-url")

Doc = dict[str, Any]


def render(capsys: pytest.CaptureFixture[str], *argv: str) -> list[Doc]:
    assert main(["deploy", "k8s", *argv]) == 0
    return [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def container(workload: Doc) -> Doc:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_deployment(docs: list[Doc]) -> None:
    """Schema validity plus the cross-references a schema cannot see."""
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: no bundled schema; checked structurally below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for w in workloads(docs)}
    for w in workloads(docs):
        assert selects(w["spec"]["selector"]["matchLabels"], pods[w["metadata"]["name"]])
        c = container(w)
        port_names = {p["name"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                action = c[probe].get("httpGet") or c[probe]["tcpSocket"]
                assert action["port"] in port_names, (w["metadata"]["name"], probe)
        env_names = {e["name"] for e in c.get("env", [])}
        for arg in c.get("args", []):
            if "$(" in arg:
                assert arg.split("$(")[1].split(")")[0] in env_names, arg
    services = by_kind(docs, "Service")
    for name, svc in services.items():
        targets = [labels for labels in pods.values() if selects(svc["spec"]["selector"], labels)]
        assert len(targets) == 1, f"service {name} selects {len(targets)} workloads"
        (target,) = [w for w in workloads(docs)
                     if selects(svc["spec"]["selector"], pods[w["metadata"]["name"]])]
        target_ports = {p["name"] for p in container(target)["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= target_ports
    for sts in by_kind(docs, "StatefulSet").values():
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        assert sum(selects(pdb["spec"]["selector"]["matchLabels"], labels)
                   for labels in pods.values()) == 1
    for monitor in by_kind(docs, "ServiceMonitor").values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        chosen = [s for s in services.values()
                  if selects(monitor["spec"]["selector"]["matchLabels"],
                             s["metadata"]["labels"])]
        components = sorted(s["metadata"]["labels"]["app.kubernetes.io/component"]
                            for s in chosen)
        assert components == ["decode", "prefill", "router"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            # the dashboard's queries select P and D by a `component` label
            assert {"sourceLabels": [
                "__meta_kubernetes_service_label_app_kubernetes_io_component"],
                "targetLabel": "component"} in endpoint["relabelings"]
        scraped = {s["metadata"]["name"]: [p for p in s["spec"]["ports"]
                                           if p["name"] in {e["port"] for e in
                                                            monitor["spec"]["endpoints"]}]
                   for s in chosen}
        assert all(len(ports) == 1 for ports in scraped.values()), scraped
        check_router_scrape(docs, chosen, scraped)


def check_router_scrape(docs: list[Doc], chosen: list[Doc],
                        scraped: dict[str, list[Doc]]) -> None:
    """The ServiceMonitor reaches every router replica on its internal listener (complete
    /metrics, no key: docs/security.md), never through the public router Service."""
    (router_svc,) = [s for s in chosen
                     if s["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    assert router_svc["spec"]["clusterIP"] == "None", "one target per replica"
    (port,) = scraped[router_svc["metadata"]["name"]]
    router = container(by_kind(docs, "Deployment")[
        router_svc["metadata"]["name"].removesuffix("-metrics")])
    target = {p["name"]: p["containerPort"] for p in router["ports"]}[port["targetPort"]]
    argv = list(router["args"])
    assert flag_values(argv, "--internal-port") == [str(target)], (port, argv)
    assert flag_values(argv, "--internal-host") == ["0.0.0.0"], "Prometheus reaches the pod IP"


def router_argv(docs: list[Doc]) -> list[str]:
    (router,) = [w for w in workloads(docs)
                 if w["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    c = container(router)
    assert c["command"][-1] == "route"
    return list(c["args"])


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def engine(docs: list[Doc], role: str) -> Doc:
    (sts,) = [d for d in by_kind(docs, "StatefulSet").values()
              if d["metadata"]["labels"]["app.kubernetes.io/component"] == role]
    return sts


def test_two_p_two_d_three_routers_with_a_redis(capsys):
    docs = render(capsys, "--prefill", "2", "--decode", "2", "--router-replicas", "3",
                  "--tool-call-parser", "hermes")
    check_deployment(docs)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment"] * 2 + ["Service"] * 5 + ["StatefulSet"] * 2
                           + ["PodDisruptionBudget"] * 3 + ["ServiceMonitor"])
    assert engine(docs, "prefill")["spec"]["replicas"] == 2
    assert engine(docs, "decode")["spec"]["replicas"] == 2
    router = by_kind(docs, "Deployment")["kvrelay-router"]
    assert router["spec"]["replicas"] == 3
    argv = router_argv(docs)
    assert flag_values(argv, "--prefill") == [
        "http://kvrelay-prefill-0.kvrelay-prefill:8000",
        "http://kvrelay-prefill-1.kvrelay-prefill:8000"]
    assert flag_values(argv, "--decode") == [
        "http://kvrelay-decode-0.kvrelay-decode:8000",
        "http://kvrelay-decode-1.kvrelay-decode:8000"]
    assert flag_values(argv, "--state") == ["redis://kvrelay-redis:6379/0"]
    assert "kvrelay-redis" in by_kind(docs, "Service")
    # Each replica names its own pod IP for D's reports, on the internal port.
    assert flag_values(argv, "--internal-url") == ["http://$(POD_IP):8001"]
    assert flag_values(argv, "--internal-host") == ["0.0.0.0"]
    ports = {p["name"]: p["containerPort"] for p in container(router)["ports"]}
    assert ports == {"http": 8000, "internal": 8001}
    env = {e["name"]: e for e in container(router)["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_engines_get_the_kv_transfer_config_and_nixl_side_channel_they_need(capsys):
    docs = render(capsys, "--tool-call-parser", "hermes", "--gpus-per-node", "2",
                  "--pod-cidr", "10.244.0.0/16", "--pod-cidr", "fd00::/8")
    check_deployment(docs)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        c = container(engine(docs, role))
        assert c["command"] == ["vllm", "serve"]
        args = c["args"]
        kv = json.loads(flag_values(args, "--kv-transfer-config")[0])
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_connector_module_path"] == "kvrelay.vllm_plugin.connector"
        assert kv["kv_role"] == kv_role and kv["kv_buffer_device"] == "cuda"
        assert kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert extra["bidirectional_kv_xfer"] is True
        assert extra["decoder_kv_blocks_ttl"] == 480
        assert extra["kv_recompute_threshold"] == 64
        assert extra.get("kvrelay_report_hosts") == (
            ["10.244.0.0/16", "fd00::/8"] if role == "decode" else None)
        env = {e["name"]: e for e in c["env"]}
        assert (env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
                == "status.podIP")
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert flag_values(args, "--tensor-parallel-size") == ["2"]
        assert flag_values(args, "--tool-call-parser") == ["hermes"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    p_args = container(engine(docs, "prefill"))["args"]
    d_args = container(engine(docs, "decode"))["args"]
    assert "--no-enable-prefix-caching" in p_args and "--enable-prefix-caching" in d_args


def test_a_data_parallel_d_gets_its_ranks_gpus_and_side_channels(capsys):
    """``--decode-data-parallel 4``: vLLM's ``--data-parallel-size`` on D (one URL, the
    router names each follow-up's rank), each rank with ``--gpus-per-node`` GPUs and its
    side channel at the port + its rank; P as it was."""
    docs = render(capsys, "--gpus-per-node", "2", "--decode-data-parallel", "4")
    check_deployment(docs)
    d, p = container(engine(docs, "decode")), container(engine(docs, "prefill"))
    assert flag_values(d["args"], "--data-parallel-size") == ["4"]
    assert flag_values(d["args"], "--tensor-parallel-size") == ["2"]
    assert d["resources"]["requests"]["nvidia.com/gpu"] == "8"
    assert d["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert [port["containerPort"] for port in d["ports"]] == [8000, 5600, 5601, 5602, 5603]
    assert flag_values(p["args"], "--data-parallel-size") == []
    assert p["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert [port["containerPort"] for port in p["ports"]] == [8000, 5600]


def test_external_redis_deploys_none(capsys):
    docs = render(capsys, "--redis-url", "redis://redis.shared.svc:6379/3",
                  "--namespace", "llm", "--no-service-monitor")
    check_deployment(docs)
    assert not any("redis" in d["metadata"]["name"] for d in docs)
    assert flag_values(router_argv(docs), "--state") == ["redis://redis.shared.svc:6379/3"]
    assert {d["metadata"]["namespace"] for d in docs} == {"llm"}
    assert "ServiceMonitor" not in {d["kind"] for d in docs}


def test_toml_input_with_flags_on_top(capsys, tmp_path: Path):
    config = tmp_path / "deploy.toml"
    config.write_text(
        '[k8s]\nname = "agents"\nmodel = "Qwen/Qwen3-32B"\nprefill = 3\ndecode = 4\n'
        'router_replicas = 2\ngpus_per_node = 4\nttl_s = 900\ntool_call_parser = "hermes"\n'
        'decode_engine_args = ["--max-num-seqs=64"]\nservice_monitor_labels = ["release=prom"]\n'
        'engine_memory = "200Gi"\n')
    docs = render(capsys, "--config", str(config), "--decode", "5")
    check_deployment(docs)
    assert engine(docs, "prefill")["spec"]["replicas"] == 3
    assert engine(docs, "decode")["spec"]["replicas"] == 5  # the flag wins
    argv = router_argv(docs)
    assert len(flag_values(argv, "--decode")) == 5
    assert flag_values(argv, "--ttl-s") == ["900"]
    assert flag_values(argv, "--deployment") == ["agents"]
    d = container(engine(docs, "decode"))
    assert d["args"][0] == "Qwen/Qwen3-32B" and d["args"][-1] == "--max-num-seqs=64"
    assert d["resources"]["limits"]["memory"] == "200Gi"
    kv = json.loads(flag_values(d["args"], "--kv-transfer-config")[0])
    assert kv["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 900
    assert by_kind(docs, "ServiceMonitor")["agents"]["metadata"]["labels"]["release"] == "prom"
    assert all(d["metadata"]["name"].startswith("agents") for d in docs)


def test_one_p_one_d_single_router(capsys):
    docs = render(capsys, "--prefill", "1", "--decode", "1", "--router-replicas", "1",
                  "--internal-port", "9100", "--router-port", "9000")
    check_deployment(docs)
    argv = router_argv(docs)
    assert flag_values(argv, "--prefill") == ["http://kvrelay-prefill-0.kvrelay-prefill:8000"]
    assert flag_values(argv, "--decode") == ["http://kvrelay-decode-0.kvrelay-decode:8000"]
    assert flag_values(argv, "--internal-url") == ["http://$(POD_IP):9100"]
    assert by_kind(docs, "Deployment")["kvrelay-router"]["spec"]["replicas"] == 1


def test_commands_parse_with_the_servers_own_parsers(capsys):
    """Every engine argument is one vLLM's server accepts (its own parser and checks), and
    every router argument one ``kvrelay route`` accepts (or the internal-listener flags)."""
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    docs = render(capsys, "--prefill", "2", "--decode", "2", "--tool-call-parser", "hermes",
                  "--max-model-len", "32768", "--engine-arg=--max-num-seqs=32",
                  "--decode-data-parallel", "2")
    for role in ("prefill", "decode"):
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(
            container(engine(docs, role))["args"])
        validate_parsed_serve_args(args)
        assert args.model_tag == "Qwen/Qwen3-8B" and args.max_num_seqs == 32
        assert args.tool_call_parser == "hermes" and args.enable_auto_tool_choice
    parsed, unknown = build_parser().parse_known_args(["route", *router_argv(docs)])
    assert parsed.state == "redis://kvrelay-redis:6379/0"
    assert [a for a in unknown if a.startswith("--")] in (
        [], list(INTERNAL_LISTENER_FLAGS)), unknown


@pytest.mark.parametrize(("settings", "message"), [
    ({"prefill": 0}, "prefill must be at least 1"),
    ({"name": "Bad_Name"}, "lowercase"),
    ({"decode": "2"}, "decode must be an integer"),
    ({"replicas": 2}, "unknown setting 'replicas'"),
    ({"internal_port": 8000}, "internal_port must differ"),
    ({"pod_cidrs": "10.0.0.0/8"}, "list of strings"),
    ({"service_monitor_labels": ["release"]}, "KEY=VALUE"),
])
def test_bad_settings_are_named(settings, message):
    with pytest.raises(DeployConfigError, match=message):
        from_settings(settings)


def test_bad_flag_is_a_clear_error_not_a_traceback(capsys, tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("decode = 'two'\n")
    assert main(["deploy", "k8s", "--config", str(bad)]) == 2
    assert "decode must be an integer" in capsys.readouterr().err


def test_defaults_render_valid_manifests(capsys):
    check_deployment(render(capsys))
    assert DeployConfig().router_internal_port == 8001


def test_liveness_and_the_scrape_need_no_metrics_key(capsys):
    """With the public /metrics locked (``--metrics-key``) or gone (``--metrics-listener
    internal``), the router's liveness probe and Prometheus still get it: both ask the
    internal listener, which serves /metrics complete to whoever reaches it. On the public
    port the probe would get 401 or 404 and restart every replica in a loop."""
    docs = render(capsys, "--router-secret", "kvrelay-router-keys",  # KVRELAY_METRICS_KEY
                  "--router-arg=--metrics-listener=internal")
    check_deployment(docs)
    router = container(by_kind(docs, "Deployment")["kvrelay-router"])
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    probe = router["livenessProbe"]["httpGet"]
    assert probe["path"] == "/metrics"
    assert ports[probe["port"]] == int(flag_values(router["args"], "--internal-port")[0])
    services = by_kind(docs, "Service")
    public = services["kvrelay-router"]
    assert "kvrelay.io/metrics" not in public["metadata"]["labels"], \
        "the public router Service is not scraped"
    assert [p["targetPort"] for p in services["kvrelay-router-metrics"]["spec"]["ports"]] \
        == ["internal"]


def test_keys_come_from_the_router_secret_never_from_args(capsys):
    """Replicas need one tag key (docs/router.md, "Several replicas") and a production
    router API keys: they come from a Secret as ``KVRELAY_*`` env; a key in ``--router-arg``
    (the pod's args, visible to whoever reads the pod spec) is refused."""
    docs = render(capsys, "--router-replicas", "2", "--router-secret", "kv-keys")
    router = container(by_kind(docs, "Deployment")["kvrelay-router"])
    assert router["envFrom"] == [{"secretRef": {"name": "kv-keys"}}]
    assert not any("key" in a for a in router["args"])
    assert "envFrom" not in container(engine(docs, "decode"))  # the keys are the router's
    plain = container(by_kind(render(capsys), "Deployment")["kvrelay-router"])
    assert "envFrom" not in plain
    for flag in ("--api-key=t:k", "--admin-key=root", "--tag-key=" + "x" * 20,
                 "--metrics-key=m"):
        with pytest.raises(DeployConfigError, match="router Secret"):
            from_settings({"router_args": [flag]})


@pytest.mark.parametrize(("arg", "message"), [
    ("--no-such-flag", "unrecognized arguments: --no-such-flag"),
    # abbreviations the router would take: a key in the args, another port
    ("--api-k=t:secret", "unrecognized arguments: --api-k=t:secret"),
    ("--po=9000", "unrecognized arguments: --po=9000"),
    ("--max-in-flight=many", "invalid int value"),
    ("--port=9000", "--port is set by the manifest; use --router-port"),
    ("--drain-timeout-s=600", "use --drain-timeout-s"),
    ("--state=redis://elsewhere:6379/0", "use --redis-url"),
    ("--check-config", "would make every replica exit"),
])
def test_router_args_are_checked_with_the_routers_own_parser(arg, message):
    """An extra router argument the router would refuse (its pod crash-loops) or one that
    overrides what the manifest derives ports, probes and the grace period from is an
    error at render time, not a deployment that never becomes ready."""
    with pytest.raises(DeployConfigError, match=re.escape(message)):
        from_settings({"router_args": [arg]})
    assert from_settings({"router_args": ["--max-in-flight=64"]}).router_args == (
        "--max-in-flight=64",)


@pytest.mark.parametrize(("args", "message"), [
    (["--ttl-s", "20"], "near_expiry_s (15) plus ttl_safety_margin_s (10) must be below"),
    (["--router-arg=--max-in-flight=0"], "max_in_flight must be >= 1"),
    (["--router-arg=--tenant-is-one-caller"], "tenant_is_one_caller needs API keys"),
])
def test_routers_that_would_refuse_their_settings_are_not_rendered(capsys, args, message):
    """The config each router replica builds from its arguments is built when rendering:
    a value it refuses is an error here, not replicas that exit at start and crash-loop."""
    assert main(["deploy", "k8s", *args]) == 2
    err = capsys.readouterr().err
    assert "the router would refuse its settings" in err and message in err
    # the Secret's keys count as present: what needs them renders with one
    assert main(["deploy", "k8s", "--router-arg=--tenant-is-one-caller",
                 "--router-secret", "keys"]) == 0


@pytest.mark.parametrize(("settings", "message"), [
    ({"pod_cidrs": ["10.244.0.0/33"]}, "'10.244.0.0/33' is not a network"),
    ({"pod_cidrs": ["notacidr"]}, "'notacidr' is not a network"),
    ({"pod_cidrs": ["10.244.0.0/16,10.245.0.0/16"]}, "one per --pod-cidr"),
    ({"engine_args": ["--port=9000"]}, "engine_args: --port is set by the manifest"),
    ({"decode_engine_args": ["--kv-transfer-config", "{}"]},
     "decode_engine_args: --kv-transfer-config is set by the manifest"),
    ({"prefill_engine_args": ["--block-size=32"]}, "use --block-size"),
    # vLLM's parser takes its short forms, `_` for `-` and abbreviations (probe 15, L4)
    ({"engine_args": ["-tp=2"]}, "-tp is set by the manifest (--tensor-parallel-size)"),
    ({"engine_args": ["--tensor_parallel_size=2"]}, "use --gpus-per-node"),
    ({"engine_args": ["--block_size=32"]}, "(--block-size)"),
    ({"decode_engine_args": ["--kv_transfer_config={}"]}, "(--kv-transfer-config)"),
    ({"engine_args": ["--kv-transfer-c={}"]}, "(--kv-transfer-config)"),
    ({"decode_engine_args": ["-dp=2"]}, "use --prefill-data-parallel, --decode-data-parallel"),
    ({"decode_data_parallel": 3, "engine_port": 5602}, "side_channel_port must differ"),
    ({"router_args": ["--response-store=memory"], "router_replicas": 2},
     "--response-store memory keeps each replica's own store"),
])
def test_settings_the_deployment_would_break_on_are_refused_at_render_time(
        settings: dict[str, Any], message: str) -> None:
    """Probe 14 (K5, K9, K10): a pod network that is none (D's connector raised on it, or
    refused every report), an engine argument that overrides what the manifest derives
    ports, probes and kvrelay's connector from (the last value wins in vLLM), and a memory
    response store behind several replicas (another replica's ``previous_response_id`` is
    a 400) rendered without a word."""
    with pytest.raises(DeployConfigError, match=re.escape(message)):
        from_settings(settings)
    assert from_settings({"pod_cidrs": ["10.244.0.0/16", "fd00::/64"],
                          "engine_args": ["--max-num-seqs=64"],
                          "router_args": ["--response-store=memory"],
                          "router_replicas": 1}).pod_cidrs == ("10.244.0.0/16", "fd00::/64")


def test_prometheus_config_writes_an_absolute_key_file_as_given(
        tmp_path: Path, capsys: Any) -> None:
    """The key file is read by Prometheus on its host: an absolute path is written as given
    (the documented /etc/prometheus/kvrelay-metrics.key failed on any machine without it:
    probe 14, K11); a relative one must exist here and is written resolved."""
    absolute = "/etc/prometheus/nowhere-here/kvrelay-metrics.key"
    out = tmp_path / "prom.yml"
    assert main(["deploy", "prometheus-config", "--router", "http://10.0.0.5:8000",
                 "--router-metrics-key-file", absolute, "--output", str(out)]) == 0
    assert f"credentials_file: {absolute}" in out.read_text()
    assert main(["deploy", "prometheus-config", "--router", "http://10.0.0.5:8000",
                 "--router-metrics-key-file", "no-such-relative.key"]) == 2
    assert "no such file here" in capsys.readouterr().err
