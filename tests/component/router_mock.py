"""A scripted in-memory P/D cluster behind ``httpx.MockTransport``, for router tests that need
exact control of failures (which request fails, how, and when a D report arrives).

It speaks the vLLM 0.32 shapes the router relies on (see ``tests/data/vllm-0.32.0``):
``/tokenize``, P answers with ``do_remote_prefill`` params, D answers (streamed or not) with
``prompt_token_ids``/``token_ids`` under ``return_token_ids`` and, non-streamed, its retained
params. Tokenization is byte-level over a toy chat template; output tokens are lower-case
ASCII derived from the prompt (and, with ``temperature > 0``, from a per-request sample), so a
conversation can be continued with the decoded text. These are stock vLLM nodes: no
fingerprint in D's params and no ``kvrelay_guard`` in P's, so a router in ``auto`` guard mode
tokenizes on P and asks D for ``return_token_ids``.

What P read is recorded (``reads``): a pull reads what D retained for that request id, and
the way vLLM does, pairing the *last* ``ceil(n / block_size)`` ids of the list it was sent
with its blocks. ``wrong_reuses`` lists the pulls whose KV is not the prompt's prefix (wrong
tokens, wrong blocks, unknown request); ``double_reads`` the D requests read more than once
(vLLM frees D's blocks after one read: a second read gets whatever reuses them).

Faults are queued per node and consumed by generation requests, one per request:
``"connect"``, ``"timeout"``, ``"reset"``, ``("status", code)``, ``("die_after", k)``,
``"error_event"``, ``"bad_json"``, ``"hang"`` (wait until ``release`` is set).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvrelay.router.config import RouterConfig
from tests.costs import fixed

Fault = str | tuple[str, int]


def template(
    messages: list[dict[str, Any]], add_generation_prompt: bool = True, preamble: str = ""
) -> str:
    text = preamble + "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def tokens_of(text: str) -> list[int]:
    return list(text.encode())


def generate(prompt: list[int], count: int) -> list[int]:
    digest = hashlib.blake2b(bytes(t % 256 for t in prompt), digest_size=32).digest()
    return [97 + digest[i % 32] % 26 for i in range(count)]


@dataclass
class MockNode:
    node_id: str
    role: str
    url: str
    engine_id: str
    side_port: int
    faults: deque[Fault] = field(default_factory=deque)
    health: int | str = 200
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    health_checks: int = 0

    def generation_requests(self) -> list[dict[str, Any]]:
        return [b for p, b in self.requests if p.startswith("/v1/")]


@dataclass(frozen=True)
class Retained:
    """What D kept for one request: the tokens (prompt + output - 1) and its block ids."""

    tokens: list[int]
    block_ids: list[int]
    text: str


@dataclass(frozen=True)
class Read:
    """One pull by P: the D request it read, how many tokens, and whether the KV it got is
    the prompt's prefix (``correct``)."""

    request_id: str
    num_tokens: int
    correct: bool


class MockCluster:
    """``report_mode``: ``after`` (D posts its report once the stream was read), ``before``
    (posts as the last chunk is produced), ``never``, or ``manual`` (kept in
    ``held_reports`` until ``deliver_reports()``)."""

    def __init__(
        self,
        num_prefill: int = 1,
        num_decode: int = 1,
        *,
        report_mode: str = "after",
        final_chunk_params: bool = False,
        default_max_tokens: int = 8,
        block_size: int = 16,
        extra_blocks: int = 0,
    ) -> None:
        self.nodes: dict[str, MockNode] = {}
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                nid = f"{role}-{i}"
                self.nodes[f"{nid}.test"] = MockNode(
                    nid, role, f"http://{nid}.test", f"engine-{nid}-1", 5600 + len(self.nodes)
                )
        self.report_mode = report_mode
        self.final_chunk_params = final_chunk_params
        self.default_max_tokens = default_max_tokens
        self.block_size = block_size
        self.extra_blocks = extra_blocks  # > 0: D lists more blocks than its tokens need
        # rendered before every chat prompt: change it to model a chat template that renders
        # the same messages differently (a new template, today's date in the system prompt)
        self.preamble = ""
        self.transport = httpx.MockTransport(self.handle)
        self.router_app: Any = None
        self.held_reports: list[dict[str, Any]] = []
        self.held_block_ids: list[list[int]] = []  # D's retained lists, in order
        self.retained: dict[str, Retained] = {}  # by D's remote_request_id
        self.reads: list[Read] = []
        self._samples = itertools.count(1)
        self.report_results: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    def node(self, node_id: str) -> MockNode:
        return next(n for n in self.nodes.values() if n.node_id == node_id)

    @property
    def prefill_urls(self) -> list[str]:
        return [n.url for n in self.nodes.values() if n.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        return [n.url for n in self.nodes.values() if n.role == "decode"]

    def config(self, **settings: Any) -> RouterConfig:
        defaults: dict[str, Any] = {
            "kv_recompute_threshold": 16, "report_wait_s": 2.0, "port": 18000, **fixed(),
        }
        return RouterConfig.from_urls(
            self.prefill_urls, self.decode_urls, **{**defaults, **settings}
        )

    async def deliver_reports(self) -> None:
        held, self.held_reports = self.held_reports, []
        for body in held:
            await self._post_report(body)

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    @property
    def wrong_reuses(self) -> list[Read]:
        return [r for r in self.reads if not r.correct]

    @property
    def double_reads(self) -> list[str]:
        ids = [r.request_id for r in self.reads]
        return sorted({i for i in ids if ids.count(i) > 1})

    def retained_for(self, text: str) -> list[str]:
        """D request ids whose answer was ``text``."""
        return [rid for rid, r in self.retained.items() if r.text == text]

    # -- the transport ----------------------------------------------------------------------

    async def handle(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._handle(request)
        except (KeyError, TypeError, ValueError, AttributeError, UnicodeError) as exc:
            # what vLLM's request validation would answer
            return httpx.Response(400, json={"error": {
                "message": f"mock: invalid request: {exc!r}", "type": "BadRequestError",
                "param": None, "code": 400}})

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        node = self.nodes[request.url.host]
        path = request.url.path
        if path == "/health":
            node.health_checks += 1
            if node.health == "connect":
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(int(node.health))
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "mock"}]})
        body = json.loads(request.content)
        node.requests.append((path, body))
        if path == "/tokenize":
            return httpx.Response(200, json=self._tokenize(body))
        fault = node.faults.popleft() if node.faults else None
        if fault == "connect":
            raise httpx.ConnectError("connection refused", request=request)
        if fault == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if fault == "reset":
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        if fault == "hang":
            await node.release.wait()
        if isinstance(fault, tuple) and fault[0] == "status":
            code = fault[1]
            return httpx.Response(code, json={"error": {
                "message": f"mock error {code}", "type": "MockError", "param": None,
                "code": code}})
        if fault == "bad_json":
            return httpx.Response(200, content=b"not json")
        if body.get("model") == "missing":
            return httpx.Response(404, json={"error": {
                "message": "The model `missing` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404}})
        chat = path == "/v1/chat/completions"
        prompt = self._prompt(body, chat)
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        if not isinstance(limit, int) or len(prompt) + limit > 4096:
            raise ValueError("This model's maximum context length is 4096 tokens")
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode") is True or node.role == "prefill":
            return httpx.Response(200, json=self._prefill(node, body, prompt, chat))
        return self._decode(node, body, prompt, chat, fault)

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            text = template(body["messages"], body.get("add_generation_prompt", True),
                            self.preamble)
        else:
            text = body["prompt"]
        ids = tokens_of(text)
        return {"count": len(ids), "max_model_len": 4096, "tokens": ids, "token_strs": None}

    def _prompt(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            return tokens_of(template(body["messages"], body.get("add_generation_prompt", True),
                                      self.preamble))
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        return list(prompt) if isinstance(prompt, list) else tokens_of(prompt)

    def _params(
        self, node: MockNode, direction: str, num_tokens: int, **extra: Any
    ) -> dict[str, Any]:
        n = next(self._ids)
        rid = f"{node.node_id}-req-{n}"
        count = -(-num_tokens // self.block_size) + (self.extra_blocks if direction == "d2p" else 0)
        return {
            "do_remote_prefill": direction == "p2d",
            "do_remote_decode": direction == "d2p",
            "remote_block_ids": [[1000 * n + i for i in range(count)]],
            "remote_engine_id": node.engine_id,
            "remote_request_id": rid,
            "remote_host": "127.0.0.1",
            "remote_port": node.side_port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "remote_blocks_expiry_time": 123.0 if direction == "d2p" else None,
            "transfer_mode": "pull",
            **extra,
        }

    def _prefill(
        self, node: MockNode, body: dict[str, Any], prompt: list[int], chat: bool
    ) -> dict[str, Any]:
        sent = body.get("kv_transfer_params") or {}
        pulled = 0
        if sent.get("remote_block_ids"):
            pulled = min(int(sent["remote_num_tokens"]), len(prompt))
            if pulled > 0:
                self.reads.append(self._read(sent, prompt, pulled))
        params = self._params(node, "p2d", len(prompt), remote_prefill_cached_tokens=pulled)
        return self._full(body, chat, generate(prompt, 1), prompt, params, with_ids=False)

    def _read(self, sent: dict[str, Any], prompt: list[int], num_tokens: int) -> Read:
        rid = str(sent["remote_request_id"])
        held = self.retained.get(rid)
        need = -(-num_tokens // self.block_size)
        ids = list(sent["remote_block_ids"][0])
        correct = (
            held is not None
            and sent.get("remote_engine_id") == self.node(rid.split("-req-")[0]).engine_id
            and num_tokens <= len(held.tokens)
            and held.tokens[:num_tokens] == prompt[:num_tokens]
            and len(ids) >= need and ids[len(ids) - need:] == held.block_ids[:need]
        )
        return Read(rid, num_tokens, correct)

    def _full(self, body: dict[str, Any], chat: bool, out: list[int], prompt: list[int],
              params: dict[str, Any] | None, *, with_ids: bool) -> dict[str, Any]:
        text = bytes(out).decode()
        ids = out if with_ids else None
        pids = prompt if with_ids else None
        if chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": "length", "token_ids": ids}
            top: dict[str, Any] = {"prompt_token_ids": pids}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                      "token_ids": ids, "prompt_token_ids": pids}
            top = {}
        return {
            "id": f"resp-{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "model": "mock", "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                      "total_tokens": len(prompt) + len(out)},
            **top, "kv_transfer_params": params,
        }

    def _decode(self, node: MockNode, body: dict[str, Any], prompt: list[int], chat: bool,
                fault: Fault | None) -> httpx.Response:
        count = body.get("max_tokens") or body.get("max_completion_tokens")
        temperature = body.get("temperature")
        sampled = isinstance(temperature, int | float) and temperature > 0
        salt = list(next(self._samples).to_bytes(4, "little")) if sampled else []
        out = generate(prompt + salt, count or self.default_max_tokens)
        params = self._params(node, "d2p", len(prompt) + len(out) - 1)
        self.held_block_ids.append(params["remote_block_ids"][0])
        self.retained[params["remote_request_id"]] = Retained(
            prompt + out[:-1], list(params["remote_block_ids"][0]), bytes(out).decode())
        with_ids = bool(body.get("return_token_ids"))
        sent = body.get("kv_transfer_params") or {}
        report = None
        if sent.get("kvrelay_report_url"):
            report = {"turn_id": sent["kvrelay_turn_id"], "kv_transfer_params": params,
                      "num_prompt_tokens": len(prompt), "num_output_tokens": len(out)}
        if not body.get("stream"):
            if isinstance(fault, tuple) and fault[0] == "die_after":
                raise httpx.ReadError("connection reset")
            self._report(report)
            return httpx.Response(200, json=self._full(body, chat, out, prompt, params,
                                                       with_ids=with_ids))
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"},
            content=self._stream(chat, out, prompt, params, with_ids, report, fault,
                                 usage=_include_usage(body)),
        )

    async def _stream(self, chat: bool, out: list[int], prompt: list[int], params: dict[str, Any],
                      with_ids: bool, report: dict[str, Any] | None,
                      fault: Fault | None, *, usage: bool) -> AsyncIterator[bytes]:
        rid = f"stream-{next(self._ids)}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        die = fault[1] if isinstance(fault, tuple) and fault[0] == "die_after" else None
        if chat:
            yield _sse({"id": rid, "object": obj, "model": "mock", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": prompt if with_ids else None, "prompt_text": None})
        if fault == "error_event":
            yield _sse({"error": {"message": "KV load failed", "type": "InternalServerError",
                                  "param": None, "code": 500}})
            yield b"data: [DONE]\n\n"
            return
        for i, tok in enumerate(out):
            if die is not None and i >= die:
                raise httpx.ReadError("connection reset mid-stream")
            final = i == len(out) - 1
            text = chr(tok)
            choice: dict[str, Any]
            if chat:
                choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
                          "finish_reason": "length" if final else None,
                          "token_ids": [tok] if with_ids else None}
            else:
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": "length" if final else None,
                          "prompt_token_ids": prompt if (with_ids and i == 0) else None,
                          "token_ids": [tok] if with_ids else None}
            chunk: dict[str, Any] = {"id": rid, "object": obj, "model": "mock",
                                     "choices": [choice]}
            if final and self.final_chunk_params:
                chunk["kv_transfer_params"] = params
            if final and self.report_mode == "before" and report is not None:
                await self._post_report(report)
            yield _sse(chunk)
        if usage:  # vLLM's usage chunk: no choices
            yield _sse({"id": rid, "object": obj, "model": "mock", "choices": [], "usage": {
                "prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(out),
                "completion_tokens": len(out)}})
        if self.report_mode != "before":
            self._report(report)  # a task: runs once the router has read [DONE]
        yield b"data: [DONE]\n\n"

    def _report(self, report: dict[str, Any] | None) -> None:
        if report is None or self.report_mode == "never":
            return
        if self.report_mode == "manual":
            self.held_reports.append(report)
            return
        task = asyncio.get_running_loop().create_task(self._post_report(report))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post_report(self, report: dict[str, Any]) -> None:
        transport = httpx.ASGITransport(app=self.router_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            resp = await c.post("/internal/kv-report", json=report)
            self.report_results.append(resp.json())


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()
