"""What the router does differently for vLLM 0.32 and 0.33 D nodes (fake engines, real HTTP).

0.32 streams carry no ``kv_transfer_params``: a streamed turn's entry needs kvrelay's D-side
report. 0.33 puts D's retained params on the final chunk (``null`` on earlier chunks, and
``null`` on the final one when D retained nothing), and kvrelay's connector on D still
reports: the router commits from the final chunk without waiting for the report, counts the
report that follows ``late``, and commits once. 0.33 params also carry
``remote_registration_generation``, which must travel unchanged from P's params to D and from
D's retained params to P's pull (docs/vllm-versions.md).

Each test names the versions it runs on (``KVRELAY_FAKE_VLLM_VERSION`` does not apply here:
this file is the same in both runs of ``make test``, which runs it once).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kvrelay.core.params import REPORT_TURN_KEY, REPORT_URL_KEY
from kvrelay.core.report import report_body
from kvrelay.fakevllm import FakeEngine, FakeEngineConfig
from kvrelay.fakevllm.versions import REGISTRATION_GENERATION_KEY, VLLM_VERSIONS, VllmVersion
from kvrelay.router.engine_check import REFUTED_FOR_S
from kvrelay.router.metrics import RouterMetrics
from tests.component.router_fake import GUARD_CONFIGS, PermitSleep, Routed, routed, until
from tests.component.router_rig import assert_no_internal_fields, sse_events, stream_text

FIRST = "Explain how a lighthouse keeper spent a winter night, hour by hour. " * 5
FOLLOW_UPS = ["And at dawn?", "What did the keeper eat?"]
GUARDS = list(GUARD_CONFIGS)


def config(version: VllmVersion, guard: str = "connector", **changes: Any) -> FakeEngineConfig:
    return replace(GUARD_CONFIGS[guard], vllm_version=version, **changes)


def count(metrics: RouterMetrics, family: str, label: str) -> float:
    value: float = getattr(metrics, family).labels(label)._value.get()
    return value


class Chat:
    """One conversation through the router; every answer checked for internal fields."""

    def __init__(self, r: Routed, *, stream: bool, endpoint: str = "chat") -> None:
        self.r = r
        self.stream = stream
        self.endpoint = endpoint
        self.messages: list[dict[str, Any]] = []
        self.prompt = ""
        self.last: tuple[dict[str, Any], str] = ({}, "")

    def body(self, user: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "stream": self.stream,
                                "conversation_id": "lighthouse"}
        if self.endpoint == "chat":
            body["messages"] = [*self.messages, {"role": "user", "content": user}]
        else:
            body["prompt"] = self.prompt + user
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def turn(self, user: str) -> str:
        body = self.body(user)
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        async with self.r.client() as c:
            resp = await c.post(path, json=body)
        assert resp.status_code == 200, resp.text
        payloads = sse_events(resp.text) if self.stream else [resp.json()]
        assert_no_internal_fields(payloads)
        assert REGISTRATION_GENERATION_KEY not in resp.text
        if self.stream:
            text = stream_text(payloads)
        else:
            choice = payloads[0]["choices"][0]
            text = choice["message"]["content"] if self.endpoint == "chat" else choice["text"]
        if self.endpoint == "chat":
            self.messages = [*body["messages"], {"role": "assistant", "content": text}]
        else:
            self.prompt = body["prompt"] + text
        self.last = (body, text)
        return text

    async def last_equals_a_recompute(self) -> bool:
        """Whether the last answer is what a plain recompute of its request gives."""
        body, text = self.last
        return await self.r.recompute(body, self.endpoint) == text  # type: ignore[arg-type]


def d_records(d: FakeEngine) -> list[Any]:
    """D's records of generation requests the router sent (P's params or direct)."""
    return [rec for rec in d.records if rec.request_kv_transfer_params is not None]


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_registration_generation_travels_unchanged_and_each_turn_commits_once(
    version: VllmVersion, stream: bool, endpoint: str, guard: str
) -> None:
    """Three turns, each settled: turns 2-3 pull and equal a recompute; each turn commits
    exactly one entry (on 0.33 streamed: from the final chunk; only the first stream asks
    for a report, counted ``late`` if it comes). What P returned reaches D unchanged,
    generation included, and what D retained reaches P's pull unchanged; 0.32 params have
    no generation anywhere."""
    async with routed(engine_config=config(version, guard)) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        chat = Chat(r, stream=stream, endpoint=endpoint)
        for user in [FIRST, *FOLLOW_UPS]:
            await chat.turn(user)
            await r.settle()
            assert await chat.last_equals_a_recompute()
        decisions = (await r.stats())["decisions"]["recent"]
        assert [x["reason"] for x in decisions] == ["no_entry", "pull", "pull"]
        metrics = r.ctx.metrics
        assert count(metrics, "turn_entries", "committed") == 3
        assert len(r.ctx.index) == 1
        late_reports = count(metrics, "reports", "late")
        matched = count(metrics, "reports", "matched")
        p_turns = [rec for rec in p.records if rec.kv_transfer_params is not None]
        d_turns = d_records(d)
        asked = [REPORT_URL_KEY in (rec.request_kv_transfer_params or {}) for rec in d_turns]
        if stream and version == "0.32":
            assert asked == [True] * 3 and matched == 3 and late_reports == 0
        elif stream:  # once D's final chunk carried its params, no more reports are asked
            assert asked == [True, False, False] and matched + late_reports == 1
        else:
            assert asked == [False] * 3 and matched == late_reports == 0
        assert len(p_turns) == len(d_turns) == 3
        generation = 1 if version == "0.33" else None
        for p_rec, d_rec in zip(p_turns, d_turns, strict=True):
            returned = p_rec.kv_transfer_params or {}
            received = d_rec.request_kv_transfer_params or {}
            assert received.get(REGISTRATION_GENERATION_KEY) == generation
            assert returned.get(REGISTRATION_GENERATION_KEY) == generation
            assert received["remote_engine_id"] == p.engine_id
        for d_rec, pull in zip(d_turns[:-1], p_turns[1:], strict=True):
            retained = d_rec.kv_transfer_params or {}
            asked = pull.request_kv_transfer_params or {}
            assert retained.get(REGISTRATION_GENERATION_KEY) == generation
            assert asked.get(REGISTRATION_GENERATION_KEY) == generation
            assert asked["remote_request_id"] == retained["remote_request_id"]
            assert pull.plan == "pull" and pull.pulled_matches_prompt


@pytest.mark.parametrize("guard", GUARDS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_a_streamed_turn_whose_report_never_comes(
    version: VllmVersion, endpoint: str, guard: str
) -> None:
    """D's connector may not post to the router (``report_hosts`` leaves it out). 0.32: the
    streamed turn has no entry, the next turn recomputes (``no_entry``); 0.33: the final
    chunk is enough, the next turn pulls. Either way the answers equal a recompute."""
    engine = config(version, guard, report_hosts=())
    async with routed(engine_config=engine, report_wait_s=0.05, report_timeout_s=0.05) as r:
        p, d = r.cluster.prefill[0], r.cluster.decode[0]
        chat = Chat(r, stream=True, endpoint=endpoint)
        await chat.turn(FIRST)
        report = d_records(d)[-1].report
        assert report is not None and report.status is None
        assert report.error is not None and "not in report_hosts" in report.error
        await until(lambda: len(r.ctx.desk) == 0, "the first turn settled")
        await chat.turn(FOLLOW_UPS[0])
        assert await chat.last_equals_a_recompute()
        await r.settle()
        decision = await r.last_decision()
        metrics = r.ctx.metrics
        if version == "0.33":
            assert decision["reason"] == "pull"
            assert p.records[-1].plan == "pull" and p.records[-1].pulled_matches_prompt
            assert count(metrics, "turn_entries", "committed") == 2
            assert count(metrics, "turn_entries", "report_timeout") == 0
        else:
            assert decision["reason"] == "no_entry"
            assert p.records[-1].plan == "none"
            assert count(metrics, "turn_entries", "committed") == 0
            assert count(metrics, "turn_entries", "report_timeout") == 2


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_the_next_turn_waits_for_a_held_report_only_on_032(version: VllmVersion) -> None:
    """D's report is held back. 0.32: the streamed turn stays pending, the next turn waits
    for the report, then pulls. 0.33: the turn committed from its final chunk at once, the
    next turn pulls without waiting (and asks for no report); the held report, once posted,
    is ``late`` and changes nothing."""
    gate = PermitSleep()
    async with routed(engine_config=config(version, report_delay_s=0.1), sleep=gate) as r:
        metrics = r.ctx.metrics
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await until(lambda: gate.waiting == 1, "D's report held")
        if version == "0.33":
            assert len(r.ctx.desk) == 0 and len(r.ctx.index) == 1
            assert count(metrics, "turn_entries", "committed") == 1
            await chat.turn(FOLLOW_UPS[0])
        else:
            assert len(r.ctx.desk) == 1 and len(r.ctx.index) == 0
            turn2 = asyncio.create_task(chat.turn(FOLLOW_UPS[0]))
            await asyncio.sleep(0.05)
            assert not turn2.done()  # waiting for turn 1's report
            gate.grant(2)
            await turn2
        assert await chat.last_equals_a_recompute()
        assert (await r.last_decision())["reason"] == "pull"
        gate.grant(10)
        await r.settle()
        assert count(metrics, "turn_entries", "committed") == 2
        # 0.33: turn 2 asked for no report (turn 1's final chunk showed D streams params)
        assert count(metrics, "reports", "late") == (1 if version == "0.33" else 0)
        assert count(metrics, "reports", "matched") == (0 if version == "0.33" else 2)
        assert len(r.ctx.index) == 1


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_a_report_after_report_timeout(version: VllmVersion) -> None:
    """D's report comes after ``report_timeout_s``. 0.32: the turn settled without an entry,
    the report is ``late`` and commits nothing, the next turn recomputes. 0.33: the entry
    came from the final chunk long before; the report is just as ``late`` and the next turn
    pulls."""
    gate = PermitSleep()
    async with routed(engine_config=config(version, report_delay_s=0.1), sleep=gate,
                      report_timeout_s=0.05) as r:
        metrics = r.ctx.metrics
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await until(lambda: gate.waiting == 1, "D's report held")
        await until(lambda: len(r.ctx.desk) == 0, "the turn settled without its report")
        outcome = "committed" if version == "0.33" else "report_timeout"
        assert count(metrics, "turn_entries", outcome) == 1
        gate.grant(10)
        await r.cluster.drain_reports()
        assert count(metrics, "reports", "late") == 1
        assert count(metrics, "reports", "matched") == 0
        assert len(r.ctx.index) == (1 if version == "0.33" else 0)
        await chat.turn(FOLLOW_UPS[0])
        assert await chat.last_equals_a_recompute()
        assert (await r.last_decision())["reason"] == ("pull" if version == "0.33"
                                                       else "no_entry")
        gate.grant(10)
        await r.settle()


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_a_d_that_retains_nothing(version: VllmVersion) -> None:
    """Without bidirectional transfer D retains nothing. 0.33's final chunk says so
    (``"kv_transfer_params": null``): the turn settles ``no_kv`` at once, while D's report is
    still held. 0.32 learns it only from the report."""
    gate = PermitSleep()
    engine = config(version, bidirectional_kv_xfer=False, report_delay_s=0.1)
    async with routed(engine_config=engine, sleep=gate) as r:
        metrics = r.ctx.metrics
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await until(lambda: gate.waiting == 1, "D's report held")
        if version == "0.33":
            assert len(r.ctx.desk) == 0
            assert count(metrics, "turn_entries", "no_kv") == 1
        else:
            assert len(r.ctx.desk) == 1
            assert count(metrics, "turn_entries", "no_kv") == 0
        gate.grant(10)
        await r.settle()
        assert count(metrics, "turn_entries", "no_kv") == 1
        assert len(r.ctx.index) == 0
        await chat.turn(FOLLOW_UPS[0])
        assert await chat.last_equals_a_recompute()
        assert (await r.last_decision())["reason"] == "no_entry"
        gate.grant(10)
        await r.settle()


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_d_dying_mid_stream_commits_nothing(version: VllmVersion) -> None:
    """D cuts the stream before its final chunk: no params reach the router (0.33's content
    chunks carry ``null``), the client gets an error event, and no entry is kept."""
    async with routed(engine_config=config(version)) as r:
        d = r.cluster.decode[0]
        d.faults.die_after_tokens = 3
        body = Chat(r, stream=True).body(FIRST)
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=body)
        payloads = sse_events(resp.text)
        assert_no_internal_fields(payloads)
        assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["code"] == 502
        died = d.records[-1]
        assert len(died.output_token_ids) == 3  # 3 answer tokens (words) reached the client
        assert stream_text(payloads) == d.model.decode(died.output_token_ids)
        await r.settle()
        assert len(r.ctx.index) == 0
        assert count(r.ctx.metrics, "turn_entries", "committed") == 0


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_direct_needs_an_entry_only_033_streams_give_without_a_report(
    version: VllmVersion,
) -> None:
    """With D's report never arriving, a streamed turn keeps an entry only on 0.33 (from its
    final chunk); so only there does the next turn go ``direct`` (D serves it from its own
    prefix cache)."""
    engine = config(version, report_hosts=())
    async with routed(engine_config=engine, direct_enabled=True, report_wait_s=0.05,
                      report_timeout_s=0.05) as r:
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await r.settle()
        committed = count(r.ctx.metrics, "turn_entries", "committed")
        assert committed == (1 if version == "0.33" else 0)
        await chat.turn(FOLLOW_UPS[0])
        assert await chat.last_equals_a_recompute()
        expected = "direct" if version == "0.33" else "no_entry"
        assert (await r.last_decision())["reason"] == expected
        await r.settle()


async def test_a_d_that_stops_streaming_params_is_asked_for_reports_again() -> None:
    """A D whose streams carried their params gets no report target; if one of its streams
    then ends without params (it now speaks 0.32), that turn settles at once without an
    entry (``no_params``, nothing to wait for) and the next stream asks for a report again,
    so the conversation is back to pulling."""
    async with routed(engine_config=config("0.33")) as r:
        d = r.cluster.decode[0]
        chat = Chat(r, stream=True)
        for user in [FIRST, FOLLOW_UPS[0]]:
            await chat.turn(user)
            await r.settle()
        d.config = replace(d.config, vllm_version="0.32")
        await chat.turn(FOLLOW_UPS[1])
        await r.settle()
        assert count(r.ctx.metrics, "turn_entries", "no_params") == 1
        await chat.turn("And the shortest?")
        await r.settle()
        await chat.turn("Thanks.")
        assert await chat.last_equals_a_recompute()
        asked = [REPORT_URL_KEY in (rec.request_kv_transfer_params or {})
                 for rec in d_records(d)]
        assert asked == [True, False, False, True, True]
        reasons = [x["reason"] for x in (await r.stats())["decisions"]["recent"]]
        assert reasons == ["no_entry", "pull", "pull", "no_entry", "pull"]


@pytest.mark.parametrize("version", VLLM_VERSIONS)
async def test_a_d_restarted_unseen_is_asked_its_engine_and_its_streams_pull_again(
    version: VllmVersion,
) -> None:
    """D restarts between health checks and serves only streams (probe 9, finding 3). On
    0.32 nothing D answers carries its params, and its reports name the new engine: each is
    refused (``mismatch_engine``, a report never teaches an engine id), but the first makes
    the router ask D itself, one non-streamed direct completion whose answer carries D's
    params; once that check has taught it the new engine, the refused report is heard again
    and commits, so the very next turn pulls. On 0.33 the final chunk teaches it, no check.
    Before, every later 0.32 turn recomputed (``no_entry``) while D held turns nobody could
    reach."""
    async with routed(engine_config=config(version)) as r:
        d = r.cluster.decode[0]
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await r.settle()
        old_engine = d.engine_id
        await d.restart()
        for user in [*FOLLOW_UPS, "And the shortest?"]:
            await chat.turn(user)
            await r.settle()
            assert await chat.last_equals_a_recompute()
        reasons = [x["reason"] for x in (await r.stats())["decisions"]["recent"]]
        assert reasons == ["no_entry", "not_loaded", "pull", "pull"]
        assert r.ctx.nodes.trusted_identity("decode-0")[0] == d.engine_id != old_engine
        checks = r.ctx.metrics.engine_checks.labels("decode-0", "restarted")._value.get()
        checks_sent = [rec for rec in d_records(d)
                       if rec.request_kv_transfer_params == {
                           "do_remote_prefill": False, "do_remote_decode": False,
                           "kvrelay_retention_url": r.ctx.retention.url_for("decode-0"),
                           "kvrelay_retain_s": 0.001}]
        if version == "0.32":
            assert count(r.ctx.metrics, "reports", "mismatch_engine") == 1
            assert checks == 1 and len(checks_sent) == 1
            assert count(r.ctx.metrics, "reports", "matched") == 4  # the refused one again
        else:
            assert checks == 0 and checks_sent == []
        assert count(r.ctx.metrics, "turn_entries", "committed") == 4
        r.clock.advance(1.0)  # past the check's own retention time
        await until(lambda: len(d.held()) == len(r.ctx.index) == 1,
                    "D holds just the turn the router knows")


async def test_a_report_naming_another_engine_is_checked_once_and_never_believed() -> None:
    """A report that names an engine D does not run (forged, or a stale process's) makes
    the router ask D once; D's answer names its own engine, so the report stays refused,
    the known engine stays, and the same claim raises no second check for REFUTED_FOR_S:
    after that it does (in a rolling replacement behind one URL the check can reach the old
    process, and the refuted engine is D's once that one is gone: probe 11, finding 1)."""
    async with routed(engine_config=config("0.32")) as r:
        d = r.cluster.decode[0]
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        await r.settle()
        checks = r.ctx.engine_checks
        assert checks is not None
        check = checks.doubt("decode-0", "not-an-engine")
        assert check is not None and await check == "same"
        assert checks.doubt("decode-0", "not-an-engine") is None
        assert r.ctx.nodes.trusted_identity("decode-0")[0] == d.engine_id
        assert checks.doubt("decode-0", d.engine_id) is None  # the known one: nothing to ask
        r.clock.advance(REFUTED_FOR_S - 0.1)
        assert checks.doubt("decode-0", "not-an-engine") is None
        r.clock.advance(0.1)
        again = checks.doubt("decode-0", "not-an-engine")
        assert again is not None and await again == "same"


async def test_reports_refused_while_a_check_runs_are_heard_again_once_per_turn() -> None:
    """Forged reports naming other engines for one live turn, posted while the engine check
    they raised waits on D, keep one hearing of that turn pending, not one per report (probe
    11, finding 4: router memory 52 -> 228 MB); D's genuine report still commits."""
    async with routed(engine_config=config("0.32", report_hosts=())) as r:
        d = r.cluster.decode[0]
        await Chat(r, stream=False).turn(FIRST)  # D's answer: the router knows its engine
        chat = Chat(r, stream=True)
        await chat.turn("Describe a storm at sea, as the keeper saw it. " * 5)
        rec = d_records(d)[-1]
        sent = rec.request_kv_transfer_params or {}
        genuine = report_body(sent[REPORT_TURN_KEY], rec.kv_transfer_params,
                              len(rec.prompt_token_ids), len(rec.output_token_ids))
        d.faults.hang = True  # the check waits on D
        async with httpx.AsyncClient(trust_env=False) as c:
            for i in range(20):
                forged = {**genuine, "kv_transfer_params": {
                    **(genuine["kv_transfer_params"] or {}), "remote_engine_id": f"forged-{i}"}}
                assert (await c.post(sent[REPORT_URL_KEY], json=forged)).status_code < 500
            desk = r.ctx.desk
            assert count(r.ctx.metrics, "reports", "mismatch_engine") == 20
            assert len(desk._rehear) == 1 and len(desk._rehearings) == 1
            d.faults.hang = False
            await until(lambda: not desk._rehearings, "the one hearing again ended")
            assert (await c.post(sent[REPORT_URL_KEY], json=genuine)).status_code < 500
        await r.settle()
        assert count(r.ctx.metrics, "turn_entries", "committed") == 2
        await chat.turn(FOLLOW_UPS[0])
        assert (await r.last_decision())["reason"] == "pull"


async def test_a_d_that_comes_up_is_asked_its_engine_so_no_report_fixes_it() -> None:
    """While D has answered nothing but streams (0.32), the router knew D's engine and side
    channel from nothing but reports: the first report that passed the other checks fixed
    them, so one forged with a live turn id, naming another engine and side channel, was
    believed, and later pulls would have gone there. Now a D that passes a health check with
    its engine unknown is asked (``EngineChecks.learn``): the forged report names an engine
    D's own answer refuted, D's genuine one commits, and the next turn pulls from D."""
    async with routed(engine_config=config("0.32", report_hosts=())) as r:
        d = r.cluster.decode[0]
        assert r.ctx.nodes.trusted_identity("decode-0") == (None, None)
        await r.ctx.nodes.check_all()
        engine, side_channel = r.ctx.nodes.trusted_identity("decode-0")
        assert engine == d.engine_id and side_channel is not None
        checks = r.ctx.metrics.engine_checks
        assert checks.labels("decode-0", "learned")._value.get() == 1
        await r.ctx.nodes.check_all()  # known now: not asked again
        assert checks.labels("decode-0", "learned")._value.get() == 1
        chat = Chat(r, stream=True)
        await chat.turn(FIRST)
        rec = d_records(d)[-1]
        sent = rec.request_kv_transfer_params or {}
        genuine = report_body(sent[REPORT_TURN_KEY], rec.kv_transfer_params,
                              len(rec.prompt_token_ids), len(rec.output_token_ids))
        forged = {**genuine, "kv_transfer_params": {
            **(genuine["kv_transfer_params"] or {}), "remote_engine_id": "not-ds-engine",
            "remote_host": "10.0.0.66", "remote_port": 7777}}
        async with httpx.AsyncClient(trust_env=False) as c:
            told = await c.post(sent[REPORT_URL_KEY], json=forged)
            assert told.json() == {"outcome": "mismatch_engine"}
            await until(lambda: not r.ctx.desk._rehearings, "the report was heard again")
            assert r.ctx.nodes.trusted_identity("decode-0") == (engine, side_channel)
            assert (await c.post(sent[REPORT_URL_KEY], json=genuine)).json() == {
                "outcome": "matched"}
        await r.settle()
        await chat.turn(FOLLOW_UPS[0])
        assert (await r.last_decision())["reason"] == "pull"
        pull = [rec for rec in r.cluster.prefill[0].records if rec.plan == "pull"][-1]
        assert pull.pulled_from_engine == d.engine_id
