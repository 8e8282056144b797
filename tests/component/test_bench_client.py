"""The bench client against a stub router over real HTTP: TTFT from the first content chunk,
decision headers, the /stats fallback, failures returned (not raised), and a whole
``kvrelay bench --router-url`` run."""

from __future__ import annotations

import json

import pytest

from kvrelay.bench.client import ChatClient, StatsDecisions
from kvrelay.cli import main
from tests.component.bench_stub_router import TAG_KEY, StubRouter, answer_for, serve_in_thread
from tests.ports import free_port_block

MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello there"}]


@pytest.fixture
def stub():
    return StubRouter()


@pytest.fixture
def url(stub):
    with serve_in_thread(stub.app(), free_port_block(1, start=21000)) as base:
        yield base


async def test_ttft_is_the_first_content_chunk_not_the_role_chunk(stub, url):
    stub.first_content_delay_s = 0.3  # the role chunk comes at once, content 0.3 s later
    stub.token_delay_s = 0.05
    async with ChatClient(url, "tiny", extra_body={"ignore_eos": True}) as client:
        r = await client.chat(MESSAGES, max_tokens=5, conversation_id="conv-1")
    assert r.ok, r.error
    assert r.ttft_s is not None and r.ttft_s >= 0.29
    assert r.e2e_s - r.ttft_s >= 4 * 0.05 * 0.9  # four more tokens after the first
    assert r.tpot_s is not None and r.tpot_s >= 0.05 * 0.9
    assert r.text == answer_for(MESSAGES, 5)
    assert (r.prompt_tokens, r.completion_tokens) == (12, 5)
    assert r.decision is not None
    assert (r.decision.action, r.decision.reason, r.decision.source) == (
        "recompute", "no_entry", "headers")
    sent = stub.requests[0]
    assert sent["conversation_id"] == "conv-1"
    assert sent["body"]["stream"] is True
    assert sent["body"]["stream_options"] == {"include_usage": True}
    assert sent["body"]["max_tokens"] == 5 and sent["body"]["ignore_eos"] is True
    assert "conversation_id" not in sent["body"]


async def test_headers_report_later_turns(stub, url):
    async with ChatClient(url, "tiny") as client:
        await client.chat(MESSAGES, max_tokens=3, conversation_id="c")
        r = await client.chat(MESSAGES, max_tokens=3, conversation_id="c")
    assert r.decision is not None
    assert (r.decision.action, r.decision.reused_tokens) == ("pull", 6)


async def test_stats_fallback_attributes_each_turn_once(stub, url):
    stub.headers = False
    stats = StatsDecisions(tag_key=TAG_KEY)
    async with ChatClient(url, "tiny", stats=stats) as client:
        first = await client.chat(MESSAGES, max_tokens=3, conversation_id="c")
        other = await client.chat(MESSAGES, max_tokens=3, conversation_id="other")
        second = await client.chat(MESSAGES, max_tokens=3, conversation_id="c")
        # no new turn of "c" since: nothing new to attribute
        assert await stats.lookup(client.http, "c") is None
    assert first.decision is not None and first.decision.source == "stats"
    assert (first.decision.action, first.decision.reason) == ("recompute", "no_entry")
    assert other.decision is not None and other.decision.action == "recompute"
    assert second.decision is not None and second.decision.action == "pull"
    assert second.decision.reused_tokens == 6


async def test_no_headers_and_no_stats_means_unknown_decision(stub, url):
    stub.headers = False
    stub.stats = False
    stats = StatsDecisions(tag_key=TAG_KEY)
    async with ChatClient(url, "tiny", stats=stats) as client:
        r = await client.chat(MESSAGES, max_tokens=2, conversation_id="c")
    assert r.ok and r.decision is None and not stats.available


async def test_failures_are_returned_not_raised(stub, url):
    stub.fail_turns = {("c", 1)}
    async with ChatClient(url, "tiny") as client:
        r = await client.chat(MESSAGES, max_tokens=2, conversation_id="c")
        assert not r.ok and r.status == 500 and "stub failure" in (r.error or "")
        assert r.decision is not None and r.decision.action == "recompute"
        stub.error_mid_stream = True
        r = await client.chat(MESSAGES, max_tokens=2, conversation_id="d")
        assert not r.ok and "mid-stream failure" in (r.error or "")
    port = free_port_block(1, start=23000)
    async with ChatClient(f"http://127.0.0.1:{port}", "tiny") as client:
        r = await client.chat(MESSAGES, max_tokens=2)
    assert not r.ok and r.status == 0 and "Connect" in (r.error or "")


async def test_non_streamed_turn_and_model_listing(stub, url):
    async with ChatClient(url, "tiny") as client:
        r = await client.chat(MESSAGES, max_tokens=4, conversation_id="c", stream=False)
        assert await client.served_model() == "stub-model"
    assert r.ok and r.text == answer_for(MESSAGES, 4) and r.ttft_s == r.e2e_s
    assert r.tpot_s is None and r.completion_tokens == 4
    assert r.decision is not None and r.decision.action == "recompute"


def test_cli_benches_a_running_router(stub, url, tmp_path, capsys):
    out = tmp_path / "results"
    code = main(["bench", "agent", "--router-url", url, "--mode-label", "stubbed",
                 "--conversations", "3", "--turns", "3", "--system-tokens", "300",
                 "--user-tokens", "60", "--answer-tokens", "8", "--think-mean-s", "0.01",
                 "--arrival-mean-s", "0", "--salt", "t1", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads((out / "agent.json").read_text())
    summary = data["modes"]["stubbed"]
    assert summary["turns"] == 9 and summary["errors"] == 0
    assert summary["hit_rate"] == 1.0
    assert data["runs"][0]["info"]["model"] == "stub-model"
    assert data["runs"][0]["info"]["router_stats_delta"]["by_action"] == {
        "pull": 6, "recompute": 3}
    assert {r["conversation_id"] for r in data["runs"][0]["records"]} == {
        "t1-agent-0", "t1-agent-1", "t1-agent-2"}
    assert (out / "agent.md").read_text() in captured.out + "\n"
    assert (out / "agent_ttft_by_turn.png").stat().st_size > 0
    assert "[stubbed]" in captured.err
