"""The fake engine's ``/v1/responses`` and ``/v1/messages`` generations: one generation
(``generation``) shaped by ``responses_api`` or ``messages_api``.

As for chat: a non-streamed answer carries the request's params and the D-side report is
posted once the body was sent; a stream's report is posted once its last event was written
(Messages streams carry no params, so a D's report is how the router learns them; Responses
streams carry them on ``response.completed``). A KV load failure is HTTP 500 (streamed: an
error event); a full KV cache 503.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.background import BackgroundTask
from starlette.responses import Response

from kvrelay.fakevllm import messages_api, responses_api
from kvrelay.fakevllm import openai as oai
from kvrelay.fakevllm.engine import FakeEngine
from kvrelay.fakevllm.generation import (
    Generation,
    KVLoadFailed,
    admit,
    died_before_answering,
)
from kvrelay.fakevllm.kv import KVCacheFull
from kvrelay.fakevllm.requests import ParsedRequest

_JSON = "application/json"


def _error(endpoint: str, status: int, message: str | None = None) -> Response:
    body: object = oai.error_body(status, message)
    if endpoint == "messages":
        inner = oai.error_body(status, message)["error"]
        assert isinstance(inner, dict)
        body = messages_api.error_body(status, str(inner["message"]))
    return Response(oai.dumps(body), status_code=status, media_type=_JSON)


def _stream_error(endpoint: str, status: int, message: str) -> str:
    if endpoint == "messages":
        return messages_api.event("error", {"type": "error", "error": {
            "type": "internal_error", "message": message}})
    return responses_api.event("error", {"code": str(status), "message": message,
                                         "param": None}, 0)


def _head(engine: FakeEngine, parsed: ParsedRequest) -> responses_api.ResponseHead:
    inp = parsed.inp
    return responses_api.ResponseHead(
        response_id=inp.request_id, message_id=f"msg_{engine.rng.getrandbits(64):016x}",
        created=int(time.time()), model=engine.config.served_model_name, body=parsed.body,
        max_output_tokens=inp.max_tokens)


async def _report(gen: Generation) -> None:
    gen.report()


def _forced_call(engine: FakeEngine, parsed: ParsedRequest, gen: Generation
                 ) -> tuple[messages_api.ToolCall, dict[str, object]] | None:
    """A Messages request whose ``tool_choice`` forces a call: its output becomes the call's
    text (``messages_api``), and the block's head (type, a vLLM-like id, name)."""
    name = messages_api.forced_tool(parsed.body) if parsed.inp.endpoint == "messages" else None
    if name is None:
        return None
    call = messages_api.ToolCall(name)
    gen.output = call.output(engine.model, gen.output)
    head: dict[str, object] = {"type": "tool_use",
                               "id": f"chatcmpl-tool-{engine.rng.getrandbits(64):016x}",
                               "name": name}
    return call, head


async def complete(engine: FakeEngine, parsed: ParsedRequest, client: object) -> Response:
    inp = parsed.inp
    try:
        gen = await admit(engine, inp)
    except KVLoadFailed:
        return _error(inp.endpoint, 500)
    except KVCacheFull as exc:
        return _error(inp.endpoint, 503, str(exc))
    try:
        forced = _forced_call(engine, parsed, gen)
        if await died_before_answering(engine, gen, client):
            return Response(status_code=500)  # never reaches the client
        async for _ in gen.tokens():
            pass
        params = gen.finish()
    except BaseException:
        gen.abort()
        gen.report()
        raise
    text = engine.model.decode(gen.output)
    n_prompt, n_out = len(inp.prompt_token_ids), len(gen.output)
    if inp.endpoint == "responses":
        body = responses_api.response_body(_head(engine, parsed), text, n_prompt, n_out,
                                           params, complete=False)
    else:
        tool_use = forced[0].tool_use(str(forced[1]["id"]), text) if forced else None
        body = messages_api.message_body(inp.request_id, engine.config.served_model_name,
                                         text, n_prompt, n_out, params, tool_use)
    return Response(oai.dumps(body), media_type=_JSON, background=BackgroundTask(_report, gen))


async def stream(engine: FakeEngine, parsed: ParsedRequest, client: object) -> AsyncIterator[str]:
    inp = parsed.inp
    messages = inp.endpoint == "messages"
    try:
        gen = await admit(engine, inp)
    except KVLoadFailed:
        yield _stream_error(inp.endpoint, 500, "Internal server error")
        return
    except KVCacheFull as exc:
        yield _stream_error(inp.endpoint, 503, str(exc))
        return
    n_prompt = len(inp.prompt_token_ids)
    head = _head(engine, parsed)
    seq = 0

    def responses_event(kind: str, payload: dict[str, object]) -> str:
        nonlocal seq
        out = responses_api.event(kind, payload, seq)
        seq += 1
        return out

    try:
        forced = _forced_call(engine, parsed, gen)
        full = engine.model.decode(gen.output)
        span = forced[0].arguments(full) if forced else None
        if messages:
            yield messages_api.start_events(inp.request_id, engine.config.served_model_name,
                                            n_prompt, forced[1] if forced else None)
        else:
            for kind, payload in responses_api.opening_events(head):
                yield responses_event(kind, payload)
        total, sent, params = len(gen.output), 0, None
        cut = engine.faults.cut_after(total)
        if cut == 0:
            await engine.kill_connection(client)
            return
        async for token in gen.tokens():
            sent += 1
            if sent == total:
                params = gen.finish()
            text = engine.model.decode([token])
            if forced:
                lo = len(engine.model.decode(gen.output[: sent - 1]))
                hi = lo + len(text)
                if span is not None and min(hi, span[1]) > max(lo, span[0]):
                    yield messages_api.json_delta_event(
                        full[max(lo, span[0]):min(hi, span[1])])
            elif messages:
                yield messages_api.delta_event(text)
            else:
                kind, payload = responses_api.delta_event(head, text)
                yield responses_event(kind, payload)
            if sent == cut:  # die_after_tokens: the connection reset mid-stream
                await engine.kill_connection(client)
                return
        if messages:
            yield messages_api.stop_events(n_prompt, total,
                                           "tool_use" if span is not None else "max_tokens")
        else:
            final = responses_api.response_body(head, engine.model.decode(gen.output),
                                                n_prompt, total, params, complete=False)
            for kind, payload in responses_api.closing_events(head, final):
                yield responses_event(kind, payload)
    finally:
        gen.abort()
        gen.report()
