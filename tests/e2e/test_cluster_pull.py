"""The foundation, end to end: on the real local cluster a second turn's prefill pulls the
first turn's KV back from D (bidirectional NixlConnector), and the output equals recompute."""

from __future__ import annotations

import random

import pytest

from kvrelay.client.pd import PDClient
from kvrelay.client.prometheus import external_kv_tokens
from kvrelay.client.sse import chunk_content, line_chunks
from tests.e2e.conftest import RealCluster

pytestmark = pytest.mark.e2e

WORDS = "plan tool call read file write test fix build search answer result".split()


def conversation(num_words: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(num_words))},
    ]


def printable(text: str) -> bool:
    return bool(text) and all(c == "\n" or 32 <= ord(c) < 127 for c in text)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_turn2_pulls_from_decode_and_equals_recompute(real_cluster: RealCluster, stream: bool):
    with PDClient(real_cluster.prefill_url, real_cluster.decode_url, real_cluster.model) as c:
        msgs = conversation(300, seed=1 if stream else 2)
        t1 = c.turn(msgs, max_tokens=24)
        assert printable(t1.text)
        held = t1.retained
        assert held is not None and held.direction == "decode_to_prefill"
        assert held.num_tokens == t1.prefill.prompt_tokens + t1.completion_tokens - 1

        msgs2 = [*msgs, {"role": "assistant", "content": t1.text},
                 {"role": "user", "content": "Now run the tests."}]
        before = external_kv_tokens(c.metrics(real_cluster.prefill_url))
        pulled = c.turn(msgs2, max_tokens=16, reuse=held, stream=stream)
        after_pull = external_kv_tokens(c.metrics(real_cluster.prefill_url))
        recomputed = c.turn(msgs2, max_tokens=16, stream=stream)
        after_recompute = external_kv_tokens(c.metrics(real_cluster.prefill_url))

    assert after_pull - before == held.num_tokens, "P's metrics must show D's KV was pulled"
    assert after_recompute == after_pull, "the recompute turn must not pull anything"
    assert pulled.prefill.prompt_tokens == recomputed.prefill.prompt_tokens > held.num_tokens
    assert printable(pulled.text)
    assert pulled.text == recomputed.text


def test_vllm_does_not_refuse_a_second_read_of_consumed_params(real_cluster: RealCluster):
    """Characterizes vLLM 0.32: D frees retained blocks after P reads them, but nothing stops
    a second P request from reading the same (now free, soon reused) block ids again. The
    single-use guarantee therefore has to live in the router: an entry is consumed by the
    pull that uses it."""
    with PDClient(real_cluster.prefill_url, real_cluster.decode_url, real_cluster.model) as c:
        msgs = conversation(200, seed=3)
        t1 = c.turn(msgs, max_tokens=16)
        assert t1.retained is not None
        msgs2 = [*msgs, {"role": "assistant", "content": t1.text},
                 {"role": "user", "content": "And again."}]
        c.turn(msgs2, max_tokens=8, reuse=t1.retained)
        before = external_kv_tokens(c.metrics(real_cluster.prefill_url))
        c.turn(msgs2, max_tokens=8, reuse=t1.retained)
        after = external_kv_tokens(c.metrics(real_cluster.prefill_url))
    assert after - before == t1.retained.num_tokens


def test_decode_connector_reports_retained_params_of_a_streamed_turn(real_cluster: RealCluster):
    """vLLM 0.32 streams no kv_transfer_params; kvrelay's connector on D POSTs them to the
    URL the request names, and they are the params a pull needs."""
    import http.server
    import json
    import threading

    import httpx

    reports: list[dict[str, object]] = []
    arrived = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            reports.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()
            arrived.set()

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/internal/kv-report"
    try:
        with PDClient(real_cluster.prefill_url, real_cluster.decode_url,
                      real_cluster.model) as c:
            msgs = conversation(150, seed=4)
            pre = c.prefill(msgs, None)
            params = {**pre.blocks.to_json(), "kvrelay_report_url": url,
                      "kvrelay_turn_id": "turn-42"}
            body = {"model": real_cluster.model, "messages": msgs, "max_tokens": 12,
                    "stream": True, "kv_transfer_params": params}
            with httpx.stream("POST", f"{real_cluster.decode_url}/v1/chat/completions",
                              json=body, timeout=120) as resp:
                lines = [line for line in resp.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert arrived.wait(30)
            report = reports[0]
            assert report["turn_id"] == "turn-42"
            assert report["num_prompt_tokens"] == pre.prompt_tokens
            assert report["num_output_tokens"] == 12
            from kvrelay.core.params import parse_remote_blocks
            held = parse_remote_blocks(report["kv_transfer_params"])
            assert held.direction == "decode_to_prefill"
            assert held.num_tokens == pre.prompt_tokens + 12 - 1
            text = "".join(chunk_content(chunk) for chunk in line_chunks(lines))
            msgs2 = [*msgs, {"role": "assistant", "content": text},
                     {"role": "user", "content": "ok"}]
            before = external_kv_tokens(c.metrics(real_cluster.prefill_url))
            c.prefill(msgs2, held)
            after = external_kv_tokens(c.metrics(real_cluster.prefill_url))
        assert after - before == held.num_tokens
    finally:
        server.shutdown()
