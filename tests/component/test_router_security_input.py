"""Issue #12, defects 6, 7 and 8: client input the router must refuse itself, with a 4xx and
an OpenAI error body, never a 5xx and never by forwarding it.

* 6: a body nested hundreds of levels deep in a field the router does not know (300, the
  band around 970 where parsing succeeds but re-serialising overflowed the stack, 2000).
* 7: numbers that overflow to infinity (``1e999``, ``-1e999``, ``1E400``), in a known field
  and nested in an unknown one; they must not reach an engine (which would get
  ``Infinity``, not JSON).
* 8: a trailing slash or another unknown path is a 404, never a redirect (which echoed the
  client's ``Host``), with or without an API key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.component.router_process import Rig, fake_rig, is_openai_error

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = "/v1/chat/completions"
KEYS = ("--api-key", "alice:KA", "--api-key", "bob:KB")
ALICE = {"authorization": "Bearer KA", "content-type": "application/json"}
PREFIX = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    async with fake_rig(tmp_path_factory.mktemp("router-input"), *KEYS) as started:
        yield started


def nested(kind: str, depth: int) -> str:
    return ('{"a": ' * depth + "1" + "}" * depth) if kind == "dict" else (
        "[" * depth + "1" + "]" * depth)


async def test_deep_nesting_in_an_unknown_field_is_400_never_500(rig: Rig) -> None:
    depths = [300, *range(950, 986), 2000]
    by_status: dict[str, list[str]] = {}
    before = rig.generation_requests()  # the router's own (a D's engine asked at startup)
    async with rig.router.client() as c:
        for kind in ("dict", "list"):
            for depth in depths:
                body = f'{PREFIX}, "unknown_field": {nested(kind, depth)}}}'
                resp = await c.post(CHAT, content=body, headers=ALICE)
                ok = resp.status_code == 400 and is_openai_error(resp.json(), 400)
                label = "400 + OpenAI error" if ok else f"HTTP {resp.status_code}"
                by_status.setdefault(label, []).append(f"{kind}:{depth}")
    wrong = {k: v for k, v in by_status.items() if k != "400 + OpenAI error"}
    assert not wrong, "nesting depths not refused with a 400: " + "; ".join(
        f"{status} at {_ranges(where)}" for status, where in wrong.items())
    assert rig.generation_requests() == before, "a deeply nested body reached an engine"


def _ranges(labels: list[str]) -> str:
    """``["dict:950", "dict:951", "list:300"]`` -> ``"dict 950..951, list 300"``."""
    spans: list[tuple[str, int, int]] = []
    for label in labels:
        kind, _, text = label.partition(":")
        depth = int(text)
        if spans and spans[-1][0] == kind and spans[-1][2] + 1 == depth:
            spans[-1] = (kind, spans[-1][1], depth)
        else:
            spans.append((kind, depth, depth))
    return ", ".join(f"{k} {a}" if a == b else f"{k} {a}..{b}" for k, a, b in spans)


@pytest.mark.parametrize("literal", ["1e999", "-1e999", "1E400"])
@pytest.mark.parametrize("where", ["temperature", "nested_in_unknown_field"])
async def test_numbers_that_overflow_to_infinity_are_400_and_never_forwarded(
    rig: Rig, literal: str, where: str
) -> None:
    field = (f'"temperature": {literal}' if where == "temperature"
             else f'"unknown_field": {{"deeper": [1, {{"x": {literal}}}]}}')
    before = rig.generation_requests()
    async with rig.router.client() as c:
        resp = await c.post(CHAT, content=f"{PREFIX}, {field}}}", headers=ALICE)
    forwarded = rig.generation_requests() - before
    assert resp.status_code == 400, (
        f"{literal} in {where}: HTTP {resp.status_code}, expected 400; the engines got "
        f"{forwarded} request(s) with it")
    assert is_openai_error(resp.json(), 400), resp.text
    assert forwarded == 0, f"{literal} in {where} reached an engine"


@pytest.mark.parametrize(("method", "path", "key"), [
    ("POST", "/v1/chat/completions/", None),
    ("POST", "/v1/chat/completions/", "KA"),
    ("POST", "/v1/completions/", None),
    ("GET", "/health/", None),
    ("GET", "/v1/models/", "KA"),
    ("GET", "/metrics/", None),
])
async def test_trailing_slash_and_unknown_paths_are_404_never_a_redirect(
    rig: Rig, method: str, path: str, key: str | None
) -> None:
    headers = {"host": "evil.example", "content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    async with rig.router.client(follow_redirects=False) as c:
        resp = await c.request(method, path, headers=headers,
                               content=b"{}" if method == "POST" else None)
    where = resp.headers.get("location")
    assert resp.status_code == 404, (
        f"{method} {path} ({'key' if key else 'no key'}, Host: evil.example): "
        f"HTTP {resp.status_code}" + (f", Location: {where}" if where else ""))
    assert where is None, f"404 with a Location header: {where}"
    assert is_openai_error(resp.json(), 404), resp.text
