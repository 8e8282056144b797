"""Reading a D's room from its own ``/metrics`` (``NodeRegistry.read_room``) against servers
that are not the fake engine: one that compresses what it may, one whose gauges are not
numbers (probe 11, findings 2 and 5)."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from kvrelay.router.app import create_app
from kvrelay.router.config import RouterConfig
from kvrelay.router.upstream import MAX_GET_BYTES
from tests.ports import free_ports

GAUGES = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} %s\n'
          'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
          'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="1600",'
          'num_gpu_blocks="100"} 1.0\n')


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(handler: Handler, path: str = "/metrics",
                **more: Handler) -> AsyncIterator[str]:
    """A server answering GET ``path`` with ``handler`` (and GET ``/<name>`` with each of
    ``more``); yields its URL."""
    app = web.Application()
    app.router.add_get(path, handler)
    for name, other in more.items():
        app.router.add_get(f"/{name}", other)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def read_room_of(handler: Handler) -> tuple[
        object, dict[str, float]]:
    """D's room as the router reads it from ``handler``'s ``/metrics``, and the read counts."""
    async for url in serve(handler):
        config = RouterConfig.from_urls(["http://127.0.0.1:9"], [url])
        ctx = create_app(config).ctx
        try:
            room = await ctx.nodes.read_room("decode-0")
        finally:
            await ctx.upstream.aclose()
        counts = {outcome: ctx.metrics.room_reads.labels("decode-0", outcome)._value.get()
                  for outcome in ("ok", "no_gauges", "failed")}
        return room, counts
    raise AssertionError("no server")


async def test_a_d_that_compresses_what_it_may_is_read_plainly() -> None:
    """``prometheus_client``'s ASGI app gzips ``/metrics`` for a client that accepts it, and
    the router does not decompress: it asks for an identity body, so the room is read."""
    async def compressing(request: web.Request) -> web.Response:
        body = (GAUGES % "0.25").encode()
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=gzip.compress(body), headers={"Content-Encoding": "gzip"})
        return web.Response(body=body)

    room, counts = await read_room_of(compressing)
    assert room is not None and room.free_tokens == 1200  # type: ignore[attr-defined]
    assert counts == {"ok": 1, "no_gauges": 0, "failed": 0}


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
async def test_gauges_that_are_not_numbers_are_no_room_and_counted(value: str) -> None:
    async def odd(request: web.Request) -> web.Response:
        return web.Response(text=GAUGES % value)

    room, counts = await read_room_of(odd)
    assert room is None and counts == {"ok": 0, "no_gauges": 1, "failed": 0}


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_metrics_answer_over_the_bound_is_not_read(chunked: bool) -> None:
    """Probe 11, finding F6: a 30 MB ``/metrics`` was read whole and parsed on the event
    loop every second (80 ms each). An answer over ``MAX_GET_BYTES`` is a failed read, with
    or without a ``Content-Length``; one just under it is read."""
    padding = "# " + "x" * 1022 + "\n"

    def body(num_bytes: int) -> bytes:
        text = (GAUGES % "0.25") + padding * (num_bytes // len(padding) + 1)
        return text.encode()[:num_bytes]

    for size, outcome in ((MAX_GET_BYTES + 1, "failed"), (MAX_GET_BYTES - 1, "ok")):
        async def answer(request: web.Request, size: int = size) -> web.StreamResponse:
            if not chunked:
                return web.Response(body=body(size))
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            data = body(size)
            for at in range(0, len(data), 256 * 1024):
                await response.write(data[at:at + 256 * 1024])
            await response.write_eof()
            return response

        room, counts = await read_room_of(answer)
        assert counts[outcome] == 1, (size, counts)
        assert (room is None) == (outcome == "failed")


async def test_a_d_whose_models_carry_no_length_is_asked_them_once() -> None:
    """``max_model_len`` is read from D's ``/v1/models`` at the first passing health check;
    a D whose cards carry none (not vLLM, or an old one) is not asked again at every
    check: the policy then checks no turn's length."""
    gets: list[str] = []

    async def models(request: web.Request) -> web.Response:
        gets.append(request.path)
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async for url in serve(models, "/v1/models", health=health):
        config = RouterConfig.from_urls(["http://127.0.0.1:9"], [url])
        ctx = create_app(config).ctx
        try:
            for _ in range(3):
                assert await ctx.nodes.check("decode-0")
        finally:
            await ctx.upstream.aclose()
    assert gets == ["/v1/models"]
    assert ctx.nodes.state("decode-0").max_model_len is None  # type: ignore[union-attr]
