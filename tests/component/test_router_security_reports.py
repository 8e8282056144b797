"""Issue #12, defect 4: D's reports are checked against the turn, not trusted on its id.

* Reports are served by a separate internal listener only (``--internal-host``,
  ``--internal-port``, ``--internal-url`` for the URL given to D); the public port answers
  ``POST /internal/kv-report`` with 404.
* A report with a valid turn id whose content does not match what the router sent for that
  turn (another D's engine id, another host/port, a block list inconsistent with the tokens,
  a missing or different prompt token count) is rejected and counted
  ``kvrelay_router_reports_total{outcome="mismatch..."}``; the conversation's next turn never
  sends P what it named, and it never changes a node's engine id (``/admin/nodes``).
* A report body over 1 MiB is a 413 without being parsed.
* ``outcome="unknown_turn"`` counts made-up turn ids only, not the late reports of
  non-streamed turns (which commit from the response itself).
* ``/stats`` without the admin key shows no engine ids.

How a forgery is staged: D's real report is held (its ``report_delay_s`` is a ``HeldSleep``
step), the test reads the turn id and report URL from D's recorded request params, posts its
forged report first, then lets the real one go.

The engines speak vLLM 0.32 whatever ``KVRELAY_FAKE_VLLM_VERSION`` says: there a streamed
turn's entry comes from its report, so a forged report is checked while its turn waits for
one. A 0.33 D's final chunk commits the turn before any report arrives, and every report
after that is only counted ``late`` (``test_router_fake_versions.py``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest
import pytest_asyncio

from kvrelay.client.sse import chunk_content, line_chunks
from kvrelay.fakevllm import FakeCluster, FakeEngine, FakeEngineConfig
from kvrelay.fakevllm.config import RequestRecord
from tests.component.router_process import (
    HeldSleep,
    Metrics,
    RouterProcess,
    eventually,
    is_openai_error,
    run_router,
    until,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
REPORT_PATH = "/internal/kv-report"
ADMIN = "ADM-key"
ARGS = ("--api-key", "alice:KA", "--api-key", "bob:KB", "--admin-key", ADMIN)
ALICE = {"authorization": "Bearer KA"}
CONFIG = FakeEngineConfig(report_delay_s=0.0, vllm_version="0.32")
#: D reports after a ``HeldSleep`` step (returns at once unless the test holds it).
DECODE_CONFIG = replace(CONFIG, report_delay_s=1.0, enable_prefix_caching=True)
FIRST = "Explain, step by step, how a glacier shapes a mountain valley over the ages. " * 5
FORGED_REQUEST_ID = "forged-request-id-from-a-report"
MIB = 1024 * 1024


@dataclass
class Rig:
    cluster: FakeCluster
    router: RouterProcess
    sleep: HeldSleep

    async def metrics(self) -> Metrics:
        return await self.router.metrics()

    async def settled(self) -> None:
        """Let every report posted so far reach the router and every turn settle."""
        self.sleep.release()
        await self.cluster.drain_reports()
        await eventually(self.metrics,
                         lambda m: m.value("kvrelay_router_pending_reports") in (None, 0.0),
                         "no D report pending")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    log_dir = tmp_path_factory.mktemp("router-reports")
    sleep = HeldSleep()
    async with FakeCluster(1, 2, CONFIG, decode_config=DECODE_CONFIG, sleep=sleep) as cluster, \
            run_router(cluster, log_dir, *ARGS, internal=True) as router:
        yield Rig(cluster, router, sleep)


@dataclass
class TurnResult:
    response: httpx.Response
    text: str
    decode: FakeEngine
    record: RequestRecord

    @property
    def sent_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the router sent D for this turn."""
        params = self.record.request_kv_transfer_params
        assert params is not None, "D got no kv_transfer_params"
        return params


async def turn(rig: Rig, messages: list[dict[str, str]], conversation: str, *,
               stream: bool) -> TurnResult:
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": stream,
            "conversation_id": conversation}
    async with rig.router.client() as c:
        if stream:
            async with c.stream("POST", CHAT, json=body, headers=ALICE) as resp:
                lines = [line async for line in resp.aiter_lines() if line]
            assert resp.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            chunks = list(line_chunks(lines))
            response_id = chunks[0]["id"]
            text = "".join(chunk_content(chunk) for chunk in chunks)
        else:
            resp = await c.post(CHAT, json=body, headers=ALICE)
            assert resp.status_code == 200, resp.text
            response_id = resp.json()["id"]
            text = resp.json()["choices"][0]["message"]["content"]
    found = [(e, r) for e, r in rig.cluster.records(response_id) if e in rig.cluster.decode]
    assert len(found) == 1, f"no single D record of {response_id}"
    return TurnResult(resp, text, *found[0])


def outcomes(m: Metrics) -> dict[str, float]:
    return {lab.get("outcome", ""): v for lab, v in m.find("kvrelay_router_reports_total")}


def mismatches(m: Metrics) -> float:
    return sum(v for outcome, v in outcomes(m).items() if outcome.startswith("mismatch"))


def node_view(admin: Any, node_id: str) -> Any:
    """The part of an ``/admin/nodes`` answer that describes ``node_id`` (a JSON object
    with the id as a value, or the value under the id as a key)."""
    if isinstance(admin, dict):
        if node_id in admin.values():
            return admin
        if node_id in admin:
            return admin[node_id]
        values: list[Any] = list(admin.values())
    elif isinstance(admin, list):
        values = admin
    else:
        return None
    for value in values:
        found = node_view(value, node_id)
        if found is not None:
            return found
    return None


def _params(body: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = body["kv_transfer_params"]
    return params


def other_engine(body: dict[str, Any], other: FakeEngine) -> None:
    _params(body)["remote_engine_id"] = other.engine_id


def other_host_port(body: dict[str, Any], other: FakeEngine) -> None:
    _params(body)["remote_host"] = other.side_channel_host
    _params(body)["remote_port"] = other.side_channel_port


def fewer_blocks(body: dict[str, Any], other: FakeEngine) -> None:
    groups = _params(body)["remote_block_ids"]
    _params(body)["remote_block_ids"] = [group[:-1] for group in groups]


def more_tokens(body: dict[str, Any], other: FakeEngine) -> None:
    params = _params(body)
    params["remote_num_tokens"] += 256
    params["remote_block_ids"] = [[*g, 100_000, 100_001] for g in params["remote_block_ids"]]


def no_prompt_count(body: dict[str, Any], other: FakeEngine) -> None:
    del body["num_prompt_tokens"]


def wrong_prompt_count(body: dict[str, Any], other: FakeEngine) -> None:
    body["num_prompt_tokens"] += 1


FORGERIES: dict[str, Callable[[dict[str, Any], FakeEngine], None]] = {
    f.__name__: f for f in (other_engine, other_host_port, fewer_blocks, more_tokens,
                            no_prompt_count, wrong_prompt_count)
}


async def test_reports_are_served_by_the_internal_listener_only(rig: Rig) -> None:
    router = rig.router
    messages = [{"role": "user", "content": FIRST}]
    first = await turn(rig, messages, "listener", stream=True)
    report_url = first.sent_params["kvrelay_report_url"]
    made_up = {"turn_id": "made-up-turn", "kv_transfer_params": None,
               "num_prompt_tokens": 1, "num_output_tokens": 1}
    async with router.client() as c:
        public = await c.post(REPORT_PATH, json=made_up)
    assert public.status_code == 404, (
        f"POST {REPORT_PATH} on the public port answered {public.status_code}: {public.text}")
    assert is_openai_error(public.json(), 404), public.text
    assert router.internal_port is not None, (
        f"the router has no internal listener: it does not take {router.dropped_flags}")
    assert report_url.startswith(router.internal_url + "/"), (
        f"D was told to report to {report_url}, not to the internal listener")
    before = await rig.metrics()
    async with httpx.AsyncClient(trust_env=False) as c:
        internal = await c.post(report_url, json=made_up)
    assert internal.status_code < 500, internal.text
    after = await rig.metrics()
    unknown = (after.total("kvrelay_router_reports_total", outcome="unknown_turn")
               - before.total("kvrelay_router_reports_total", outcome="unknown_turn"))
    assert unknown == 1, f"the internal listener did not take the report: {internal.text}"
    await rig.settled()
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And then?"}]
    second = await turn(rig, messages, "listener", stream=False)
    assert second.response.headers.get("x-kvrelay-action") == "pull", (
        "D's report over the internal listener did not make the next turn a pull: "
        f"{second.response.headers.get('x-kvrelay-reason')}")


@pytest.mark.parametrize("forgery", list(FORGERIES))
async def test_a_report_that_does_not_match_its_turn_is_rejected(
    rig: Rig, forgery: str
) -> None:
    cluster, router = rig.cluster, rig.router
    conversation = f"forged-{forgery}"
    messages = [{"role": "user", "content": f"[{forgery}] {FIRST}"}]
    rig.sleep.hold()  # D's real report waits
    first = await turn(rig, messages, conversation, stream=True)
    d = first.decode
    other = next(e for e in cluster.decode if e is not d)
    await until(lambda: first.record.report is not None and rig.sleep.held == 1,
                "D's report made and held")
    assert first.record.report is not None
    real = copy.deepcopy(first.record.report.body)
    assert real["turn_id"] == first.sent_params["kvrelay_turn_id"]
    forged = copy.deepcopy(real)
    FORGERIES[forgery](forged, other)
    _params(forged)["remote_request_id"] = FORGED_REQUEST_ID
    before = await rig.metrics()
    async with httpx.AsyncClient(trust_env=False) as c:
        answer = await c.post(first.sent_params["kvrelay_report_url"], json=forged)
    assert answer.status_code < 500, answer.text
    after = await rig.metrics()
    await rig.settled()  # the real report arrives too

    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Go on."}]
    second = await turn(rig, messages, conversation, stream=False)
    p_params = cluster.prefill[0].records[-1].request_kv_transfer_params or {}
    forged_params = _params(forged)
    used = {k: v for k, v in p_params.items()
            if k.startswith("remote_") and v == forged_params.get(k) != _params(real).get(k)}
    used.update({"remote_request_id": FORGED_REQUEST_ID}
                if p_params.get("remote_request_id") == FORGED_REQUEST_ID else {})
    assert not used, (
        f"the next turn ({second.response.headers.get('x-kvrelay-action')}) sent P what the "
        f"forged report ({forgery}) named: {used}")
    counted = mismatches(after) - mismatches(before)
    assert counted == 1, (
        f"the forged report ({forgery}) was not counted as a mismatch: router answered "
        f"{answer.status_code} {answer.text}; reports_total went from {outcomes(before)} to "
        f"{outcomes(after)}")
    async with router.client() as c:
        admin = await c.get("/admin/nodes", headers={"authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200, f"GET /admin/nodes: {admin.status_code}"
    found = node_view(admin.json(), d.name)
    assert found is not None, f"/admin/nodes does not describe {d.name}: {admin.text[:500]}"
    view = json.dumps(found)
    assert other.engine_id not in view, (
        f"{d.name} as /admin/nodes shows it after the forged report: {view}")
    assert FORGED_REQUEST_ID not in admin.text


async def test_unknown_turn_counts_made_up_turn_ids_not_non_streamed_turns(rig: Rig) -> None:
    before = await rig.metrics()
    done = await turn(rig, [{"role": "user", "content": FIRST}], "non-streamed", stream=False)
    await rig.settled()
    if done.record.report is not None:  # a router may ask for it: then it must be delivered
        assert done.record.report.status is not None, (
            "D's report of the non-streamed turn was not delivered")
    made_up = {"turn_id": "made-up-turn-id", "kv_transfer_params": None,
               "num_prompt_tokens": 10, "num_output_tokens": 2}
    async with httpx.AsyncClient(trust_env=False) as c:
        await c.post(rig.router.internal_url + "/internal/kv-report", json=made_up)
    after = await rig.metrics()
    unknown = (after.total("kvrelay_router_reports_total", outcome="unknown_turn")
               - before.total("kvrelay_router_reports_total", outcome="unknown_turn"))
    assert unknown == 1, (
        f"one made-up turn id and one non-streamed turn's report counted {unknown:g} "
        f"unknown_turn: {outcomes(before)} -> {outcomes(after)}")


async def test_a_report_over_1_mib_is_413_without_being_parsed(rig: Rig) -> None:
    await turn(rig, [{"role": "user", "content": FIRST}], "big-report", stream=False)
    await rig.settled()
    url = rig.router.internal_url + "/internal/kv-report"
    valid_but_big = json.dumps({
        "turn_id": "made-up-big", "kv_transfer_params": None, "num_prompt_tokens": 1,
        "num_output_tokens": 1, "pad": "x" * (MIB + 1024)}).encode()
    invalid_and_big = b"{" * (MIB + MIB // 2)

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(32):
            yield b"y" * (64 * 1024)

    before = await rig.metrics()
    got: dict[str, int] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        for what, content in (("valid JSON, 1 MiB + 1 KiB", valid_but_big),
                              ("invalid JSON, 1.5 MiB", invalid_and_big)):
            got[what] = (await c.post(url, content=content,
                                      headers={"content-type": "application/json"})).status_code
        got["chunked, 2 MiB"] = (await c.post(url, content=chunked())).status_code
    after = await rig.metrics()
    assert got == {w: 413 for w in got}, f"oversized reports: {got}"
    assert outcomes(after) == outcomes(before), "an oversized report was parsed"


async def test_stats_without_the_admin_key_shows_no_engine_ids(rig: Rig) -> None:
    await turn(rig, [{"role": "user", "content": FIRST}], "stats", stream=False)
    await rig.settled()
    async with rig.router.client() as c:
        stats = await c.get("/stats", headers=ALICE)
    assert stats.status_code == 200, stats.text
    shown = [e.name for e in rig.cluster.engines if e.engine_id in stats.text]
    assert not shown, f"alice's /stats shows the engine ids of {shown}"
