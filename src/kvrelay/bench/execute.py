"""Drive a ``Workload`` through a client (``ChatClient``, ``MessagesClient``): conversations,
think times, histories, tool calls.

Contract of ``run_workload``:

* conversations start ``start_s`` after the run starts; at most ``workload.concurrency`` run
  at once (``1``: strictly one after another, in order);
* a conversation's history is its turns' messages interleaved with the answers the server
  actually generated, so each prompt extends the previous prompt + answer exactly;
* tool calls (``TurnSpec.tool_call``: the client forces the answer to be one): an answer
  that made a tool call enters the history as that call, and the next turn's ``tool``
  messages carry its id; after an answer that made none (a forced call cut off, say) they
  are sent as user messages with the same text (``bench.tool_calls``). A record says
  whether its turn forced a call, whether the answer made one, and whether the turn
  followed one (``after_tool_call``: the previous answer was a tool call);
* before every turn but the first it sleeps ``think_s`` after the previous answer ended;
* a failed turn is recorded and ends its conversation (later turns would not extend a
  history the server holds);
* conversation ids sent are ``id_prefix + spec.conversation_id``, so runs against one
  long-lived router do not collide;
* records come back ordered by conversation (workload order), then turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvrelay.bench.client import TurnResult
from kvrelay.bench.metrics import TurnRecord
from kvrelay.bench.tokens import ChatMessage
from kvrelay.bench.tool_calls import ToolUse, answer_tool_results
from kvrelay.bench.workloads import ConversationSpec, Workload

Sleep = Callable[[float], Awaitable[None]]
#: Called after every turn with its record and how many later turns of its conversation
#: will not be sent (non-zero only after a failure).
OnTurn = Callable[[TurnRecord, int], None]


class TurnSender(Protocol):
    """What ``run_workload`` needs from a client (``ChatClient`` and ``MessagesClient`` are
    ones). ``tool_call``: force the answer to be a tool call (a client that cannot raises
    ``ValueError``); the call it made comes back in ``TurnResult.tool_call``."""

    async def chat(
        self,
        messages: list[ChatMessage],
        *,
        max_tokens: int,
        conversation_id: str | None = None,
        stream: bool = True,
        tool_call: bool = False,
    ) -> TurnResult: ...


async def run_workload(
    workload: Workload,
    client: TurnSender,
    *,
    mode: str,
    id_prefix: str = "",
    on_turn: OnTurn | None = None,
    sleep: Sleep = asyncio.sleep,
    clock: Callable[[], float] = time.perf_counter,
) -> list[TurnRecord]:
    """Run every conversation of ``workload`` (see the module contract)."""
    started = clock()
    results: dict[int, list[TurnRecord]] = {}

    async def one(index: int, conv: ConversationSpec) -> None:
        results[index] = await _conversation(
            conv, client, mode, workload.kind, id_prefix, started, on_turn, sleep, clock
        )

    if workload.concurrency <= 1:
        for i, conv in enumerate(workload.conversations):
            await _wait_until(started + conv.start_s, sleep, clock)
            await one(i, conv)
    else:
        gate = asyncio.Semaphore(workload.concurrency)

        async def gated(index: int, conv: ConversationSpec) -> None:
            await _wait_until(started + conv.start_s, sleep, clock)
            async with gate:
                await one(index, conv)

        await asyncio.gather(*(gated(i, c) for i, c in enumerate(workload.conversations)))
    return [r for i in sorted(results) for r in results[i]]


async def _wait_until(at: float, sleep: Sleep, clock: Callable[[], float]) -> None:
    delay = at - clock()
    if delay > 0:
        await sleep(delay)


async def _conversation(
    conv: ConversationSpec,
    client: TurnSender,
    mode: str,
    kind: str,
    id_prefix: str,
    run_started: float,
    on_turn: OnTurn | None,
    sleep: Sleep,
    clock: Callable[[], float],
) -> list[TurnRecord]:
    history: list[ChatMessage] = []
    records: list[TurnRecord] = []
    conversation_id = id_prefix + conv.conversation_id
    previous_call: ToolUse | None = None
    for number, spec in enumerate(conv.turns, start=1):
        if number > 1 and spec.think_s > 0:
            await sleep(spec.think_s)
        history.extend(answer_tool_results(spec.new_messages, previous_call))
        sent_at = clock() - run_started
        result = await client.chat(
            list(history), max_tokens=spec.max_tokens, conversation_id=conversation_id,
            tool_call=spec.tool_call,
        )
        decision = result.decision
        record = TurnRecord(
            mode=mode,
            workload=kind,
            conversation_id=conversation_id,
            turn=number,
            context_tokens=conv.context_tokens,
            target_tokens=spec.target_tokens,
            measured=spec.measured,
            think_s=spec.think_s if number > 1 else 0.0,
            sent_at_s=sent_at,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            ttft_s=result.ttft_s,
            tpot_s=result.tpot_s,
            e2e_s=result.e2e_s,
            action=decision.action if decision else None,
            reason=decision.reason if decision else None,
            reused_tokens=decision.reused_tokens if decision else None,
            decision_source=decision.source if decision else None,
            error=result.error,
            released_cause=decision.released_cause if decision else None,
            tool_call=spec.tool_call,
            made_tool_call=result.tool_call is not None,
            after_tool_call=previous_call is not None,
        )
        records.append(record)
        if on_turn is not None:
            on_turn(record, 0 if result.ok else len(conv.turns) - number)
        if not result.ok:
            break
        previous_call = result.tool_call
        history.append(previous_call.message() if previous_call is not None
                       else {"role": "assistant", "content": result.text})
    return records
