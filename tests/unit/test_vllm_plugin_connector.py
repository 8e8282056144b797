"""kvrelay's NixlConnector pieces that run without an engine: the report sender and the
NIXL progress-delay hook."""

import http.server
import json
import sys
import threading
import types

from kvrelay.core.report import ReportHosts
from kvrelay.vllm_plugin import connector


def serve_reports():
    got: list[dict] = []
    done = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()
            done.set()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got, done


def test_reporter_posts_to_allowed_hosts_only():
    server, got, done = serve_reports()
    try:
        port = server.server_address[1]
        reporter = connector._Reporter(frozenset({"127.0.0.1"}))
        reporter.submit(f"http://localhost:{port}/r", {"turn_id": "blocked"})
        reporter.submit(f"http://127.0.0.1:{port}/r", {"turn_id": "t1"})
        assert done.wait(10)
        assert got == [{"turn_id": "t1"}]
    finally:
        server.shutdown()


def test_report_hosts_take_names_addresses_and_networks():
    hosts = ReportHosts(["localhost", "10.244.0.0/16", "fd00::/8", "192.0.2.7",
                                   "Router.NS.svc"])
    assert hosts.allows("localhost") and hosts.allows("LOCALHOST")
    assert hosts.allows("router.ns.svc")
    assert hosts.allows("10.244.3.17") and not hosts.allows("10.245.0.1")
    assert hosts.allows("fd00::12") and not hosts.allows("fe80::1")
    assert hosts.allows("192.0.2.7") and not hosts.allows("192.0.2.8")
    assert not hosts.allows("evil.example") and not hosts.allows("")


def test_reporter_posts_to_hosts_inside_an_allowed_network():
    server, got, done = serve_reports()
    try:
        port = server.server_address[1]
        reporter = connector._Reporter(["127.0.0.0/8"])
        reporter.submit(f"http://localhost:{port}/r", {"turn_id": "blocked"})
        reporter.submit(f"http://127.0.0.1:{port}/r", {"turn_id": "t2"})
        assert done.wait(10)
        assert got == [{"turn_id": "t2"}]
    finally:
        server.shutdown()


def test_progress_delay_is_applied_to_agents_created_inside_the_block(monkeypatch):
    created: list[tuple[str, int]] = []

    class Config:
        pthrDelay = 0

    def real_agent(name, config):
        created.append((name, config.pthrDelay))
        return name

    bindings = types.SimpleNamespace(nixlAgent=real_agent)
    monkeypatch.setitem(sys.modules, "nixl._api", types.SimpleNamespace(nixlBind=bindings))
    with connector._nixl_progress_delay(1000):
        bindings.nixlAgent("a", Config())
    bindings.nixlAgent("b", Config())
    assert created == [("a", 1000), ("b", 0)]
    assert bindings.nixlAgent is real_agent


class _Request:
    def __init__(self, params):
        self.kv_transfer_params = params


def test_a_processed_pull_is_not_requested_again(monkeypatch):
    """After a failed D->P read, vLLM schedules the request again; answering the same async
    load again would park it in WAITING_FOR_REMOTE_KVS forever (docs/cpu-notes.md #6)."""
    asked: list[dict] = []

    def parent(self, request, num_computed_tokens):
        asked.append(request.kv_transfer_params)
        return 512, True

    monkeypatch.setattr(connector.NixlPullConnector, "get_num_new_matched_tokens", parent)
    conn = object.__new__(connector.NixlConnector)
    conn._skip_processed_pull = True
    d_params = {"do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]],
                "remote_num_tokens": 512}
    assert conn.get_num_new_matched_tokens(_Request(dict(d_params)), 0) == (512, True)
    processed = {**d_params, "do_remote_prefill": False, "_remote_blocks_processed": True}
    assert conn.get_num_new_matched_tokens(_Request(processed), 0) == (0, False)
    p_params = {"do_remote_prefill": True, "_remote_blocks_processed": True}
    assert conn.get_num_new_matched_tokens(_Request(p_params), 0) == (512, True)
    assert conn.get_num_new_matched_tokens(_Request(None), 0) == (512, True)
    assert len(asked) == 3


def test_processed_pulls_go_to_vllm_where_its_scheduler_handles_them(monkeypatch):
    """With fix 3 off (a vLLM whose scheduler checks the mark itself), vLLM decides."""
    conn = object.__new__(connector.NixlConnector)
    conn._skip_processed_pull = False
    processed = {"do_remote_decode": True, "remote_block_ids": [[1]], "remote_num_tokens": 16,
                 "_remote_blocks_processed": True}
    calls: list[int] = []
    monkeypatch.setattr(connector.NixlPullConnector, "get_num_new_matched_tokens",
                        lambda self, request, n: calls.append(n) or (16, True))
    assert conn.get_num_new_matched_tokens(_Request(processed), 0) == (16, True)
    assert calls == [0]


class _TransferConfig:
    def __init__(self, extra):
        self.extra = extra

    def get_from_extra_config(self, key, default):
        return self.extra.get(key, default)


def test_fix_plan_on_this_cpu_vllm_keeps_all_fixes_the_operator_asked_for():
    plan = connector._fix_plan(_TransferConfig({"kvrelay_nixl_progress_delay_us": 1000}))
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        True, 1000, True)
    plan = connector._fix_plan(_TransferConfig({"kvrelay_restore_affinity": False}))
    assert (plan.restore_affinity, plan.progress_delay_us, plan.skip_processed_pull) == (
        False, 0, True)


def test_vllm_finds_the_connector_where_the_launcher_says_it_is():
    """``kv_connector_module_path`` as ``kvrelay up`` and ``deploy k8s`` write it names this
    module, and the class there has the name vLLM switches on."""
    import importlib

    from kvrelay.vllm_plugin.settings import CONNECTOR_MODULE_PATH, CONNECTOR_NAME

    module = importlib.import_module(CONNECTOR_MODULE_PATH)
    assert module is connector
    assert issubclass(getattr(module, CONNECTOR_NAME), connector.NixlPullConnector)


class _Finished:
    """What ``request_finished`` reads of vLLM's ``Request``."""

    def __init__(self, params, prompt, output):
        self.kv_transfer_params = params
        self.prompt_token_ids = prompt
        self.output_token_ids = output
        self.num_prompt_tokens = len(prompt)
        self.num_output_tokens = len(output)


def _finishing_connector(monkeypatch, returned):
    monkeypatch.setattr(connector.NixlPullConnector, "request_finished",
                        lambda self, request, block_ids: (True, returned))
    conn = object.__new__(connector.NixlConnector)
    conn._block_size = 4
    conn._reporter = None
    return conn


def test_d_marks_the_params_it_retains_with_the_fingerprint_of_its_own_tokens(monkeypatch):
    from kvrelay.core.fingerprint import held_fingerprint
    from kvrelay.core.params import parse_remote_blocks

    retained = {"do_remote_decode": True, "do_remote_prefill": False,
                "remote_block_ids": [[7, 8, 9]], "remote_engine_id": "d",
                "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 5601,
                "remote_num_tokens": 9}
    conn = _finishing_connector(monkeypatch, retained)
    prompt, output = list(range(100, 106)), [1, 2, 3, 4]
    _, params = conn.request_finished(_Finished({}, prompt, output), [[7, 8, 9]])
    blocks = parse_remote_blocks(params)
    assert (blocks.guard_version, blocks.block_size) == (1, 4)
    assert blocks.fingerprint == held_fingerprint(prompt, output, 9)


def test_p_answers_how_many_tokens_its_guard_verified(monkeypatch):
    answer = {"do_remote_prefill": True, "remote_num_tokens": 6}
    conn = _finishing_connector(monkeypatch, answer)
    sent = {"do_remote_decode": True, "kvrelay_verified_tokens": 5}
    _, params = conn.request_finished(_Finished(sent, [1] * 6, [2]), [[1]])
    assert params == {"do_remote_prefill": True, "remote_num_tokens": 6, "kvrelay_guard": 1,
                      "kvrelay_verified_tokens": 5}


def test_d_reports_where_the_router_asked_with_the_report_body(monkeypatch):
    submitted: list[tuple[str, dict]] = []
    conn = _finishing_connector(monkeypatch, None)
    conn._reporter = types.SimpleNamespace(submit=lambda url, body: submitted.append((url, body)))
    url = "http://127.0.0.1:8001/internal/kv-report"
    sent = {"kvrelay_report_url": url, "kvrelay_turn_id": "t1"}
    conn.request_finished(_Finished(sent, [1, 2, 3], [4, 5]), [[1]])
    conn.request_finished(_Finished({"kvrelay_report_url": url}, [1], [2]), [[1]])
    assert submitted == [(url, {"turn_id": "t1", "kv_transfer_params": None,
                                "num_prompt_tokens": 3, "num_output_tokens": 2})]
