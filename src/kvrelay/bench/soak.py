"""The client side of a soak: concurrent streaming multi-turn conversations that churn
through new conversation ids, through the router or (``direct``) P then D without it.

Used by ``scripts/soak.py`` (processes, sampling, report) and by
``tests/component/test_router_soak.py`` (a short in-process version).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.bench.rawhttp import Conn, host_port
from kvrelay.core.params import request_remote_decode

USER = "Describe, step by step, how a river delta forms and changes over the centuries. " * 3
FOLLOW_UPS = ["Go on.", "Be more specific about the sediments.", "What about floods?",
              "Compare it with an estuary.", "Summarize in two lines."]


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    action: str = ""


@dataclass
class LoadResult:
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    conversations: int = 0
    wall_s: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.samples) + len(self.errors)

    def pct(self, q: float, attr: str = "ttft_s") -> float:
        values = sorted(getattr(s, attr) for s in self.samples)
        if not values:
            return float("nan")
        return float(values[min(len(values) - 1, int(q * len(values)))])


@dataclass
class Target:
    """Where the load goes: ``router`` (URL) or, in ``direct`` mode, P and D URLs."""

    router: str | None = None
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)


async def stream_turn(conns: Mapping[str, Conn], mode: str, messages: list[dict[str, str]],
                      conversation_id: str | None, max_tokens: int) -> tuple[str, Sample]:
    """One streamed turn: ``mode`` ``direct`` speaks the P/D protocol itself (P with
    ``max_tokens=1``, then a stream from D; ``conns["p"]``, ``conns["d"]``), any other mode
    streams through ``conns["router"]`` (with ``conversation_id`` when given). Returns the
    reply text and its timings; raises like ``Conn.stream``."""
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": max_tokens,
                            "stream": True}
    path = "/v1/chat/completions"
    started = time.perf_counter()
    if mode == "direct":
        p_body = {**body, "stream": False, "max_tokens": 1,
                  "kv_transfer_params": request_remote_decode()}
        p = await conns["p"].post_json(path, p_body)
        d_body = {**body, "kv_transfer_params": p["kv_transfer_params"]}
        text, ttft, headers = await conns["d"].stream(path, d_body, started)
    else:
        if conversation_id is not None:
            body["conversation_id"] = conversation_id
        text, ttft, headers = await conns["router"].stream(path, body, started)
    action = headers.get("x-kvrelay-action", "")
    return text, Sample(ttft, time.perf_counter() - started, action)


async def _client(idx: int, target: Target, mode: str, result: LoadResult, *,
                  stop: Callable[[int], bool], turns: tuple[int, int], max_tokens: int,
                  seed: int, tag: str) -> None:
    rng = random.Random(f"{seed}:{idx}")
    conns: dict[str, Conn] = {}
    if mode == "direct":
        conns["p"] = Conn(*host_port(target.prefill[idx % len(target.prefill)]))
        conns["d"] = Conn(*host_port(target.decode[idx % len(target.decode)]))
    else:
        assert target.router is not None
        conns["router"] = Conn(*host_port(target.router))
    n = 0
    try:
        while not stop(n):
            conv_id = f"{tag}-{idx}-{n}"
            n += 1
            result.conversations += 1
            messages = [{"role": "user", "content": f"[{conv_id}] {USER}"}]
            for _ in range(rng.randint(*turns)):
                try:
                    text, sample = await stream_turn(conns, mode, messages, conv_id, max_tokens)
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                        RuntimeError, ValueError, KeyError) as exc:
                    result.errors.append(f"{mode} client {idx} {conv_id}: {exc!r}")
                    for c in conns.values():
                        c.close()
                    break
                result.samples.append(sample)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
    finally:
        for c in conns.values():
            c.close()


async def run_load(target: Target, *, mode: str = "router", clients: int,
                   duration_s: float | None = None, conversations_per_client: int | None = None,
                   turns: tuple[int, int] = (2, 6), max_tokens: int = 16, seed: int = 0,
                   tag: str = "soak", result: LoadResult | None = None) -> LoadResult:
    """``clients`` concurrent clients, each running conversation after conversation (a new
    conversation id each) until ``duration_s`` is over or it ran
    ``conversations_per_client`` of them."""
    result = result if result is not None else LoadResult()
    started = time.perf_counter()
    deadline = started + duration_s if duration_s is not None else None

    def stop(done: int) -> bool:
        if conversations_per_client is not None and done >= conversations_per_client:
            return True
        return deadline is not None and time.perf_counter() >= deadline

    await asyncio.gather(*(
        _client(i, target, mode, result, stop=stop, turns=turns, max_tokens=max_tokens,
                seed=seed, tag=tag)
        for i in range(clients)))
    result.wall_s = time.perf_counter() - started
    return result
