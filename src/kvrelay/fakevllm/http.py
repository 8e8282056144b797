"""The fake engine's HTTP API: vLLM's OpenAI endpoints plus a small ``/fake`` admin API.

vLLM endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST
/v1/responses`` and ``POST /v1/messages`` (streamed or not; ``agent_http``),
``POST /v1/messages/count_tokens``, ``GET /v1/models``, ``GET /health``, ``POST /tokenize``,
``GET /metrics``.
Admin: ``GET|POST /fake/faults`` (see ``faults``), ``GET /fake/info`` (engine id,
side channel, held blocks, the waiting queue, kvrelay's retention and its syncs),
``GET /fake/requests/{id}`` (a ``RequestRecord`` as JSON).

Error semantics follow vLLM: invalid requests get 400/404 ``ErrorResponse`` bodies; a KV load
failure under policy ``fail`` is HTTP 500 (streamed: HTTP 200 with the role chunk, an error
chunk and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvrelay.fakevllm import agent_http
from kvrelay.fakevllm import messages_api as anthropic
from kvrelay.fakevllm import openai as oai
from kvrelay.fakevllm.engine import FakeEngine, Listen, Received
from kvrelay.fakevllm.generation import Generation, KVLoadFailed, admit, died_before_answering
from kvrelay.fakevllm.kv import KVCacheFull
from kvrelay.fakevllm.requests import (
    BadRequest,
    ParsedRequest,
    agent_prompt,
    parse_generation,
    tokenize,
)
from kvrelay.fakevllm.server import HttpServer

Handler = Callable[[Request], Awaitable[Response]]
_JSON = "application/json"


def json_response(obj: object, status: int = 200) -> Response:
    return Response(oai.dumps(obj), status_code=status, media_type=_JSON)


def error_response(status: int, message: str | None = None, param: str | None = None) -> Response:
    return json_response(oai.error_body(status, message, param), status)


def _messages_error(
    status: int, message: str | None = None, param: str | None = None
) -> Response:
    """vLLM's Messages endpoint translates its errors into Anthropic's envelope."""
    inner = oai.error_body(status, message, param)["error"]
    assert isinstance(inner, dict)
    return json_response(anthropic.error_body(status, str(inner["message"])), status)


async def _receive(engine: FakeEngine, request: Request) -> bytes:
    """The request's body, recorded in ``engine.received``."""
    raw = await request.body()
    engine.received.append(Received(request.method, request.url.path, raw))
    return raw


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def _body(engine: FakeEngine, request: Request) -> dict[str, Any]:
    return _json_object(await _receive(engine, request))


def http_listener(host: str = "127.0.0.1", port: int = 0) -> Listen:
    """An engine's ``listen``: its API (``build_app``) on an ``HttpServer`` at ``host:port``
    (``port=0``: a free one)."""

    def listen(engine: FakeEngine) -> HttpServer:
        return HttpServer(build_app(engine), host, port)

    return listen


def build_app(engine: FakeEngine, num_ranks: int = 1) -> Starlette:
    """The ASGI app of one engine (routes close over ``engine``); ``num_ranks``: the engines
    of its server (a data-parallel front's), against which a generation request's
    ``X-data-parallel-rank`` is checked as vLLM checks it."""

    async def health(request: Request) -> Response:
        engine.num_health_requests += 1
        await engine.faults.wait_while_health_hung()
        return Response(status_code=503 if engine.faults.unhealthy else 200)

    async def models(request: Request) -> Response:
        cfg = engine.config
        body = oai.models_body(
            cfg.served_model_name, engine.model.path, cfg.max_model_len, int(time.time())
        )
        return json_response(body)

    async def tokenize_route(request: Request) -> Response:
        try:
            return json_response(tokenize(engine, await _body(engine, request)))
        except BadRequest as exc:
            return error_response(exc.status, str(exc), exc.param)

    async def metrics(request: Request) -> Response:
        return Response(
            engine.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def generation(endpoint: str) -> Handler:
        fail = _messages_error if endpoint == "messages" else error_response

        async def handle(request: Request) -> Response:
            raw = await _receive(engine, request)
            await engine.faults.wait_while_hung()
            status = engine.faults.take_error()
            if status is not None:
                return fail(status)
            rank = _data_parallel_rank(request)
            if rank is not None and not 0 <= rank < num_ranks:  # vLLM's InputProcessor
                return fail(400, f"data_parallel_rank {rank} is out of range "
                                 f"[0, {num_ranks}).")
            try:
                parsed = parse_generation(
                    engine, _json_object(raw), endpoint, request.headers.get("x-request-id")
                )
            except BadRequest as exc:
                return fail(exc.status, str(exc), exc.param)
            client = request.scope.get("client")
            if endpoint in ("responses", "messages"):
                if parsed.stream:
                    return StreamingResponse(agent_http.stream(engine, parsed, client),
                                             media_type="text/event-stream")
                return await _cancel_on_disconnect(
                    request, agent_http.complete(engine, parsed, client))
            if parsed.stream:
                return StreamingResponse(
                    _stream(engine, parsed, client), media_type="text/event-stream"
                )
            return await _cancel_on_disconnect(request, _complete(engine, parsed, client))

        return handle

    async def count_tokens(request: Request) -> Response:
        try:
            body = await _body(engine, request)
            return json_response(anthropic.count_body(len(agent_prompt(engine, body,
                                                                       "messages"))))
        except BadRequest as exc:
            return _messages_error(exc.status, str(exc))

    async def faults(request: Request) -> Response:
        if request.method == "GET":
            return json_response(engine.faults.to_json())
        try:
            body = await _body(engine, request)
            actions = {k: body.pop(k) for k in ("crash", "restart", "clear") if k in body}
            if actions.get("clear"):
                engine.faults.clear()
            engine.faults.update(body)
        except (BadRequest, ValueError) as exc:
            return error_response(400, str(exc))
        task = None
        if actions.get("restart") is True:
            task = BackgroundTask(_detach, engine, engine.restart)
        elif actions.get("crash") is True:
            task = BackgroundTask(_detach, engine, engine.crash)
        return Response(oai.dumps(engine.faults.to_json()), media_type=_JSON, background=task)

    async def info(request: Request) -> Response:
        out = engine.describe()
        out["held"] = [dataclasses.asdict(h) for h in engine.held()]
        state = engine.state
        out["waiting"] = state.scheduler.waiting_ids()
        out["num_preemptions"] = state.scheduler.num_preemptions
        retention, syncer = state.retention, state.syncer
        if retention is not None and syncer is not None:
            out["retention"] = {
                "turns": [msgspec.to_builtins(turn) for turn in retention.turns()],
                "releases_total": retention.releases_total,
                "released_pull_chance": retention.released_pull_chance,
                "declined_reads": retention.declined_reads,
                "syncs": {url: {"count": o.count, "status": o.status, "error": o.error}
                          for url, o in syncer.outcomes.items()},
            }
        return json_response(out)

    async def record(request: Request) -> Response:
        try:
            rec = engine.record(request.path_params["request_id"])
        except KeyError:
            return error_response(404, "unknown request id")
        out = dataclasses.asdict(rec)
        out["wrong_reuse"] = rec.wrong_reuse
        out["pulled_matches_prompt"] = rec.pulled_matches_prompt
        return json_response(out)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize_route, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/chat/completions", generation("chat"), methods=["POST"]),
            Route("/v1/completions", generation("completions"), methods=["POST"]),
            Route("/v1/responses", generation("responses"), methods=["POST"]),
            Route("/v1/messages", generation("messages"), methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/fake/faults", faults, methods=["GET", "POST"]),
            Route("/fake/info", info, methods=["GET"]),
            Route("/fake/requests/{request_id}", record, methods=["GET"]),
        ]
    )


def _data_parallel_rank(request: Request) -> int | None:
    """The ``X-data-parallel-rank`` header as vLLM reads it (not a number: none)."""
    try:
        value = request.headers.get("x-data-parallel-rank")
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """vLLM's ``with_cancellation``: a non-streamed generation whose client disconnects is
    cancelled (the request aborted, its blocks freed) instead of running to completion.
    Streams need nothing: ``StreamingResponse`` already stops when the client goes away.
    The body has been read, so every further ``receive()`` message is a disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    handler = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (handler, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(handler, watcher, return_exceptions=True)
    if handler.cancelled():
        return Response(status_code=499)  # the client is gone: nobody reads this
    return handler.result()


async def _detach(engine: FakeEngine, action: Callable[[], Awaitable[None]]) -> None:
    """Run a crash/restart after the admin response was sent, outside the request's task
    (which the crash cancels)."""

    async def run() -> None:
        await action()

    engine.spawn(run())


async def _report_after_response(gen: Generation) -> None:
    """Background task of a non-streamed response: runs once the body was sent."""
    gen.report()


async def _complete(engine: FakeEngine, parsed: ParsedRequest, client: object) -> Response:
    inp, cfg = parsed.inp, engine.config
    try:
        gen = await admit(engine, inp)
    except KVLoadFailed:
        return error_response(500)
    except KVCacheFull as exc:
        return error_response(503, str(exc))
    try:
        if await died_before_answering(engine, gen, client):
            return Response(status_code=500)  # never reaches the client
        async for _ in gen.tokens():
            pass
        params = gen.finish()
    except BaseException:
        gen.abort()
        gen.report()
        raise
    ids = gen.output if parsed.return_token_ids else None
    prompt_ids = inp.prompt_token_ids if parsed.return_token_ids else None
    head = oai.Head(inp.request_id, int(time.time()), cfg.served_model_name)
    answer = oai.Answer(
        text=engine.model.decode(gen.output),
        token_ids=ids,
        prompt_token_ids=prompt_ids,
        num_prompt_tokens=len(inp.prompt_token_ids),
        num_output_tokens=len(gen.output),
        kv_transfer_params=params,
        system_fingerprint=cfg.effective_system_fingerprint,
        weight_versions=cfg.protocol.weight_versions,
    )
    build = oai.chat_response if inp.endpoint == "chat" else oai.completion_response
    return Response(
        oai.dumps(build(head, answer)),
        media_type=_JSON,
        background=BackgroundTask(_report_after_response, gen),
    )


async def _stream(engine: FakeEngine, parsed: ParsedRequest, client: object) -> AsyncIterator[str]:
    """vLLM's SSE stream. ``finish()`` runs when the last token is produced (before its chunk
    is sent), the D-side report once ``[DONE]`` was written or the connection went away.
    On 0.33 every token chunk carries ``kv_transfer_params``: the request's params on the
    one with ``finish_reason`` (``null`` if none), ``null`` before it."""
    inp, cfg = parsed.inp, engine.config
    wire = cfg.protocol
    chat = inp.endpoint == "chat"
    head = oai.Head(inp.request_id, int(time.time()), cfg.served_model_name)
    prompt_ids = inp.prompt_token_ids if parsed.return_token_ids else None
    n_prompt = len(inp.prompt_token_ids)
    role_chunk = oai.sse(oai.chat_role_chunk(head, prompt_ids))
    try:
        gen = await admit(engine, inp)
    except KVLoadFailed:
        if chat:
            yield role_chunk
        yield oai.sse(oai.error_body(500))
        yield oai.SSE_DONE
        return
    except KVCacheFull as exc:
        yield oai.sse(oai.error_body(503, str(exc)))
        yield oai.SSE_DONE
        return
    try:
        if chat:
            yield role_chunk
        total, sent = len(gen.output), 0
        cut = engine.faults.cut_after(total)
        if cut == 0:
            gen.abort()
            await engine.kill_connection(client)
            return
        async for token in gen.tokens():
            sent += 1
            final = sent == total
            params = gen.finish() if final else None
            ids = [token] if parsed.return_token_ids else None
            text = engine.model.decode([token])
            if chat:
                chunk = oai.chat_token_chunk(head, text, ids, final=final,
                                             weight_versions=wire.weight_versions)
            else:
                first_ids = prompt_ids if sent == 1 else None
                chunk = oai.completion_chunk(head, text, ids, first_ids, final=final,
                                             weight_versions=wire.weight_versions)
            if parsed.continuous_usage:
                chunk["usage"] = oai.usage(n_prompt, sent, full=False)
            if final and not parsed.include_usage:
                chunk["system_fingerprint"] = cfg.effective_system_fingerprint
            if wire.stream_kv_params:
                chunk["kv_transfer_params"] = params
            yield oai.sse(chunk)
            if sent == cut:
                gen.abort()
                await engine.kill_connection(client)
                return
        if parsed.include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield oai.sse(
                oai.usage_chunk(head, obj, n_prompt, total, cfg.effective_system_fingerprint)
            )
        yield oai.SSE_DONE
    finally:
        gen.abort()
        gen.report()
