"""kvrelay's NixlConnector pieces that run without an engine: the report sender and the
NIXL progress-delay hook."""

import http.server
import json
import sys
import threading
import types

from kvrelay.cluster import connector


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
