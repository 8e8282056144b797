"""A router's retention endpoint standing in for the router in tests of D's side: records
each sync (checked against the contract) and answers the orders a test sets."""

from __future__ import annotations

import http.server
import json
import threading

from kvrelay.core.retention_sync import RetentionOrders, decode_sync, encode


class StandInRouter:
    def __init__(self) -> None:
        self.syncs: list[dict[str, object]] = []
        self.answer = RetentionOrders()
        self.got = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                decode_sync(body)
                sync = json.loads(body)
                outer.syncs.append(sync)
                answer = encode(outer.answer_for(sync))
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                outer.got.set()

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/internal/kv-retention"

    def answer_for(self, sync: dict[str, object]) -> RetentionOrders:
        """The answer to one sync (``answer`` unless a subclass decides per sync)."""
        return self.answer

    def close(self) -> None:
        """Stop answering and close the socket (a closed router refuses connections; one
        whose socket still listened would hold each of D's syncs to it until its timeout)."""
        self.server.shutdown()
        self.server.server_close()
