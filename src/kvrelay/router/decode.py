"""Step 3 of a turn: D decodes and its answer goes to the client; the entry's halves are
handed to the report desk (``commit``).

D gets the client's body with P's params (or, for ``direct``, params that make D serve the
whole turn from its own prefix cache), a report target when the response is streamed (vLLM
0.32 puts no params on stream chunks: kvrelay's connector posts them), and
``return_token_ids`` only when D does not fingerprint what it retains (``/tokenize`` mode),
and, to a D running kvrelay's connector, where to sync its retention and how long to keep
this turn (``router.retention``); the entry then expires on the router clock after that
time, not D's whole TTL. A D run data parallel behind one URL is asked for the rank that holds
the conversation's turn (``core.engine_group.decode_rank``), whose prefix cache has it.

Streams: D's first complete event is read before the client gets a status line, so a D
that fails before sending anything can still be retried (``BeforeFirstByte``). After that
D's bytes are relayed as they come, unparsed (``sse``). A D failure mid-stream becomes an
SSE error event and ``data: [DONE]``; a stream still open at the drain deadline ends the
same way; a client that goes away aborts D's request. In every such case the turn keeps no
entry and the entry it continued (unless consumed) is dropped.

A Responses turn with the response store on (``TurnRequest.kept``) has its response's
snapshots patched and the finished response kept before the client gets its end
(``router.response_keeper``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping

import msgspec

from kvrelay.core.engine_group import RankChoice, decode_rank, dp_rank
from kvrelay.core.identity import ToolCall, answer_digest, pack_token_ids
from kvrelay.core.params import (
    REPORT_TURN_KEY,
    REPORT_URL_KEY,
    KVParamsError,
    RemoteBlocks,
    parse_optional_remote_blocks,
)
from kvrelay.router.apis.base import StreamScanner
from kvrelay.router.asgi import DisconnectWatch, Send, send_response, start_stream
from kvrelay.router.commit import DecodeAnswer, PendingTurn
from kvrelay.router.config import NodeConfig
from kvrelay.router.sse import Rewrite, frame
from kvrelay.router.state import RouterContext
from kvrelay.router.turn import Turn, TurnState
from kvrelay.router.upstream import ByteStream, UpstreamError

log = logging.getLogger("kvrelay.router")

_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def refuses_rank(error: UpstreamError) -> bool:
    """Whether D's answer refused the rank the request named: vLLM's 400 "data_parallel_rank
    N is out of range" (``InputProcessor.process_inputs``), from a server that runs fewer
    engines than the rank's id says (``core.engine_group.addressable``)."""
    return error.status == 400 and "data_parallel_rank" in error.message


class BeforeFirstByte(Exception):
    """D failed before the client saw anything: the turn may be retried."""

    def __init__(self, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.error = error


class Decoder:
    """Runs the D step of turns for one router app (module docstring)."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx

    async def run(
        self,
        turn: Turn,
        node: NodeConfig,
        params: Mapping[str, object],
        send: Send,
        watch: DisconnectWatch,
    ) -> None:
        """Decode on ``node`` and answer the client; ``BeforeFirstByte`` if D failed before
        the client got anything."""
        ctx, req = self._ctx, turn.request
        direct = turn.decision.action == "direct"
        turn.decode_node = node
        turn.move(TurnState.DECODING)
        retention = ctx.retention.decode_params(turn, node)
        pending = ctx.desk.open(
            identity=req.identity,
            tenant=req.tenant,
            conversation=turn.conversation,
            number=turn.number,
            decode_node_id=node.node_id,
            ttl_s=retention.retain_s,
            num_prompt_tokens=None if direct else turn.prompt_tokens,
            max_output_tokens=req.max_output_tokens,
            plan=retention.plan,
        )
        turn.pending = pending
        if ctx.retention.learns:
            pending.on_settle.append(ctx.retention.settled)
        if turn.found is not None and not turn.decision.consumes_entry:
            pending.supersedes = turn.found
        family = req.adapter.stream_family
        pending.awaits_report = req.stream and not ctx.nodes.streams_params(node.node_id, family)
        ids = not ctx.nodes.fingerprints(node.node_id) or req.prompt_token_ids is not None
        d_params = dict(params)
        if pending.awaits_report:
            d_params[REPORT_URL_KEY], d_params[REPORT_TURN_KEY] = \
                ctx.config.report_url, pending.turn_id
        if retention.keys is not None:
            d_params.update(retention.keys)
        body = req.adapter.decode_body(req.body, d_params, token_ids=ids)
        rewrite = Rewrite(
            cached_tokens=turn.cached_tokens
            if not direct and (req.include_usage or not req.stream) else None,
            strip_ids=(ids or not req.stream) and not req.wants_token_ids,
            collect_ids=ids,
        )
        d_prefill = max(0, turn.prompt_tokens - turn.reused_tokens) if direct else 0
        rank = self._rank(turn, node).rank
        send_to = self._stream if req.stream else self._json
        try:
            with ctx.nodes.busy(node.node_id, d_prefill):
                try:
                    await send_to(turn, node, body, rewrite, pending, send, watch, rank)
                except BeforeFirstByte as failed:
                    if rank is None or not refuses_rank(failed.error):
                        raise
                    # D takes no rank by its id after all: D never scheduled the request,
                    # so it goes again to whichever rank vLLM's balancer picks
                    ctx.nodes.refuse_ranks(node.node_id)
                    ctx.metrics.child(ctx.metrics.decode_ranks, "refused").inc()
                    log.warning("%s refused data-parallel rank %d (%s): ranks are no longer "
                                "named to it", node.node_id, rank, failed.error.message)
                    await send_to(turn, node, body, rewrite, pending, send, watch, None)
        except BaseException:
            if pending.outcome is None:
                ctx.desk.settle(pending, "failed" if turn.outcome is None else turn.outcome)
            raise

    def _rank(self, turn: Turn, node: NodeConfig) -> RankChoice:
        """The rank of a data-parallel D the decode request names (``core.engine_group``:
        the one that holds the conversation's turn on this D), counted by reason."""
        ctx = self._ctx
        entry = turn.found.entry if turn.found is not None else None
        if entry is None or entry.decode_node_id != node.node_id:
            choice = decode_rank(None, (), rank_room_tokens=None, needed_tokens=0)
        elif dp_rank(entry.decode_engine_id) is None:  # one engine: nothing more to read
            choice = decode_rank(entry.decode_engine_id, (), rank_room_tokens=None,
                                 needed_tokens=0)
        else:
            engine = entry.decode_engine_id
            choice = decode_rank(
                engine, ctx.nodes.engines(node.node_id),
                rank_room_tokens=ctx.retention.rank_room_tokens(node.node_id, engine),
                needed_tokens=max(0, turn.prompt_tokens - entry.blocks.num_tokens),
                takes_ranks=ctx.nodes.takes_ranks(node.node_id),
                held=entry.released is None and turn.decision.reason != "expired",
                rank_waiting=ctx.nodes.rank_waiting(node.node_id, engine))
        if choice.reason not in ("no_entry", "not_data_parallel"):
            ctx.metrics.child(ctx.metrics.decode_ranks, choice.reason).inc()
        return choice

    async def _json(
        self, turn: Turn, node: NodeConfig, body: bytes, rewrite: Rewrite,
        pending: PendingTurn, send: Send, watch: DisconnectWatch, rank: int | None,
    ) -> None:
        ctx = self._ctx
        try:
            raw = await ctx.upstream.post(node, turn.request.path, body, dp_rank=rank)
            obj = _DECODER.decode(raw)
            if not isinstance(obj, dict):
                raise UpstreamError(node.node_id, "protocol", "answer is not a JSON object")
        except msgspec.DecodeError as exc:
            failure = UpstreamError(node.node_id, "protocol", f"answer is not JSON: {exc}")
            await ctx.nodes.request_failed(failure)
            raise BeforeFirstByte(failure) from exc
        except UpstreamError as exc:
            await ctx.nodes.request_failed(exc)
            raise BeforeFirstByte(exc) from exc
        read = turn.request.adapter.rewrite_body(obj, rewrite)
        kept = turn.request.kept
        if kept is not None:
            kept.patch(obj, final=True)
            await kept.commit()
        blocks = self._retained(node, read.params)
        await ctx.desk.response_finished(
            pending,
            self._answer(turn, read.text, read.calls, read.prompt_token_ids,
                         read.output_token_ids),
            blocks, retained=blocks is not None,
        )
        watch.stop()
        await send_response(send, 200, _ENCODER.encode(obj), headers=turn.headers())
        self._done(turn, "ok")

    async def _stream(
        self, turn: Turn, node: NodeConfig, body: bytes, rewrite: Rewrite,
        pending: PendingTurn, send: Send, watch: DisconnectWatch, rank: int | None,
    ) -> None:
        ctx = self._ctx
        try:
            stream = await ctx.upstream.open_stream(node, turn.request.path, body,
                                                    dp_rank=rank)
        except UpstreamError as exc:
            await ctx.nodes.request_failed(exc)
            raise BeforeFirstByte(exc) from exc
        try:
            await self._relay(turn, node, stream, rewrite, pending, send, watch)
        finally:
            await stream.aclose()

    async def _relay(
        self, turn: Turn, node: NodeConfig, stream: ByteStream, rewrite: Rewrite,
        pending: PendingTurn, send: Send, watch: DisconnectWatch,
    ) -> None:
        """D's events to the client as they come. The turn's answer is handed to the report
        desk before D's ``[DONE]`` goes out, so a client that sends its next turn at once
        finds this one pending (and waits for it) rather than missing."""
        ctx = self._ctx
        chunks = stream.chunks()
        first, carry = await self._first_events(node, chunks)
        adapter = turn.request.adapter
        scan = adapter.scanner(rewrite)
        if turn.request.kept is not None:
            scan = turn.request.kept.scanner(scan)
        await start_stream(send, turn.headers())
        turn.move(TurnState.STREAMING)
        try:
            out = scan.feed(first)
            if scan.done:
                out = await self._end(turn, node, scan, pending, out)
            await _body(send, out)
            turn.ttft_s = time.perf_counter() - turn.started_s
            ctx.metrics.child(ctx.metrics.ttft, turn.action).observe(turn.ttft_s)
            async for chunk in chunks:
                events, carry = frame(carry, chunk)
                if events:
                    was_done = scan.done
                    out = scan.feed(events)
                    if scan.done and not was_done:
                        out = await self._end(turn, node, scan, pending, out)
                    await _body(send, out)
            if carry:
                await _body(send, carry)
            if not scan.done:
                raise UpstreamError(node.node_id, "closed", "stream ended before its end event")
        except UpstreamError as exc:
            await ctx.nodes.request_failed(exc)
            await self._lose(turn, pending, "failed_mid_stream")
            watch.stop()
            await _body(send, scan.cut(502, "the decode node failed mid-stream"))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        except asyncio.CancelledError:
            if not watch.cancelled_us:
                raise
            _uncancel()
            if turn.outcome is None:
                await self._lose(turn, pending, "cut" if watch.was_cut else "client_gone")
            if watch.was_cut:
                order = watch.cut_order
                log.log(logging.INFO if order.logged else logging.DEBUG,
                        "stream of a %s turn cut %s", turn.action, order.why)
                with contextlib.suppress(OSError):
                    await _body(send, scan.cut(order.status, order.message))
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _end(
        self, turn: Turn, node: NodeConfig, scan: StreamScanner, pending: PendingTurn,
        out: bytes,
    ) -> bytes:
        """D's stream is complete: the answer (or the error it ended with) settles the turn.
        Returns ``out``, the events still to send (the end among them), with the final
        snapshot patched again when the store could not keep the response."""
        ctx = self._ctx
        if scan.error is not None:
            ctx.metrics.upstream_error(node.node_id, "error_event", None)
            await self._lose(turn, pending, "error_event")
            return out
        kept = turn.request.kept
        if kept is not None:
            await kept.commit()
            if kept.lost:
                out = kept.patch_events(out)
        text, calls = scan.answer()
        answer = self._answer(turn, text, calls, scan.prompt_token_ids, scan.output_token_ids)
        blocks = self._retained(node, scan.params) if scan.params is not None else None
        ctx.nodes.observe_stream(node.node_id, scan.params_seen, turn.request.adapter.stream_family)
        await ctx.desk.response_finished(
            pending, answer, blocks, retained=blocks is not None if scan.params_seen else None,
        )
        self._done(turn, "ok")
        return out

    async def _first_events(
        self, node: NodeConfig, chunks: AsyncIterator[bytes]
    ) -> tuple[bytes, bytes]:
        """D's first complete event(s), before the client gets anything."""
        carry = b""
        try:
            async for chunk in chunks:
                events, carry = frame(carry, chunk)
                if events:
                    return events, carry
        except UpstreamError as exc:
            await self._ctx.nodes.request_failed(exc)
            raise BeforeFirstByte(exc) from exc
        failure = UpstreamError(node.node_id, "closed", "stream ended before any event")
        await self._ctx.nodes.request_failed(failure)
        raise BeforeFirstByte(failure)

    def _retained(self, node: NodeConfig, params: object) -> RemoteBlocks | None:
        """D's retained params from its own answer (trusted: D sent them to us), or None."""
        try:
            blocks = parse_optional_remote_blocks(params)
        except KVParamsError as exc:
            log.warning("D %s returned invalid kv_transfer_params: %s", node.node_id, exc)
            return None
        if blocks is None or blocks.direction != "decode_to_prefill":
            return None
        self._ctx.nodes.observe_params(node.node_id, blocks)
        return blocks

    @staticmethod
    def _answer(
        turn: Turn, text: str, calls: list[ToolCall], prompt_ids: list[int] | None,
        output_ids: list[int],
    ) -> DecodeAnswer:
        """The answer as the next turn carries it: its digest for an item history (chat,
        Responses, Messages), else the text (or output ids) the next prompt appends."""
        chat = turn.request.identity.text is None
        carried: bytes | None = None
        if not chat:
            ids_prompt = turn.request.prompt_token_ids is not None
            carried = pack_token_ids(output_ids) if ids_prompt else text.encode("utf-8")
        return DecodeAnswer(
            chat=answer_digest(text, calls) if chat else None,
            text=carried,
            num_bytes=len(text.encode("utf-8")),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            waits_for="tool" if calls else "user",
        )

    async def _lose(self, turn: Turn, pending: PendingTurn, outcome: str) -> None:
        """The turn ended badly: no entry for it, and the entry it continued (if it was not
        consumed) is dropped."""
        ctx = self._ctx
        ctx.desk.settle(pending, outcome)
        found = turn.found
        if found is not None and not turn.decision.consumes_entry:
            with contextlib.suppress(Exception):
                if await ctx.index.drop(found.ref, found.entry):
                    ctx.metrics.dropped.labels("turn_failed").inc()
        self._done(turn, outcome)

    def _done(self, turn: Turn, outcome: str) -> None:
        if turn.finish(outcome):
            metrics = self._ctx.metrics
            metrics.child(metrics.turn_seconds, turn.action,
                          "true" if turn.request.stream else "false",
                          ).observe(time.perf_counter() - turn.started_s)


async def _body(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
