"""One agent conversation, twice through the router: with reuse and without.

``make demo`` runs this first because it answers the user's question in one table: for each
turn, what the router decided, how many prompt tokens P did not have to recompute, and the
TTFT with and without reuse. Both runs send identical messages (the answers of the reuse run
are replayed in the baseline), so the comparison is exact; greedy decoding makes the answers
of both runs equal unless reuse went wrong, which the table shows too.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import httpx

from kvrelay.bench.client import decision_from_headers
from kvrelay.client.sse import chunk_content, line_chunks, usage_of

WORDS = ("read file grep test build error fix patch commit diff plan step tool output result "
         "line function class module import return value config retry").split()


@dataclass(frozen=True)
class TurnOutcome:
    turn: int
    prompt_tokens: int
    action: str
    reason: str
    reused_tokens: int
    ttft_s: float
    text: str


@dataclass(frozen=True)
class ShowcaseResult:
    reuse: list[TurnOutcome]
    baseline: list[TurnOutcome]

    @property
    def same_output(self) -> bool:
        return [t.text for t in self.reuse] == [t.text for t in self.baseline]

    def table(self) -> str:
        lines = [
            "| turn | prompt tokens | decision (reason) | reused tokens | TTFT reuse | "
            "TTFT recompute | same answer |",
            "|---|---|---|---|---|---|---|",
        ]
        for a, b in zip(self.reuse, self.baseline, strict=True):
            lines.append(
                f"| {a.turn} | {a.prompt_tokens} | {a.action} ({a.reason}) | {a.reused_tokens} "
                f"| {a.ttft_s * 1000:.0f} ms | {b.ttft_s * 1000:.0f} ms | "
                f"{'yes' if a.text == b.text else 'NO'} |"
            )
        return "\n".join(lines)

    def summary(self) -> str:
        later_a = [t for t in self.reuse if t.turn > 1]
        later_b = [t for t in self.baseline if t.turn > 1]
        reused = sum(t.reused_tokens for t in self.reuse)
        total = sum(t.prompt_tokens for t in self.reuse)
        ttft_a = sum(t.ttft_s for t in later_a)
        ttft_b = sum(t.ttft_s for t in later_b)
        speedup = ttft_b / ttft_a if ttft_a > 0 else float("nan")
        return (
            f"Reuse saved {reused} of {total} prompt tokens ({100 * reused / max(1, total):.0f}%) "
            f"that P would have recomputed. TTFT of turns 2-{len(self.reuse)}: "
            f"{ttft_a:.2f} s with reuse vs {ttft_b:.2f} s without ({speedup:.1f}x). "
            f"Answers identical: {'yes' if self.same_output else 'NO'}."
        )


def agent_messages(
    turns: int, system_words: int, tool_words: int, seed: int
) -> tuple[list[dict[str, object]], list[list[dict[str, object]]]]:
    """The conversation's opening messages and, per later turn, the messages it appends."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    opening: list[dict[str, object]] = [
        {"role": "system", "content": f"You are a coding agent. Notes: {text(system_words)}"},
        {"role": "user", "content": "Fix the failing test in the parser module."},
    ]
    later: list[list[dict[str, object]]] = [
        [{"role": "user", "content": f"Tool output (step {i}): {text(tool_words)}"}]
        for i in range(2, turns + 1)
    ]
    return opening, later


def run_showcase(
    router_url: str,
    model: str,
    *,
    turns: int = 6,
    system_words: int = 300,
    tool_words: int = 200,
    answer_tokens: int = 32,
    seed: int = 0,
    progress: TextIO | None = None,
    timeout_s: float = 600.0,
) -> ShowcaseResult:
    """Run the conversation with a conversation id (reuse), then replay it without one."""
    opening, later = agent_messages(turns, system_words, tool_words, seed)
    conversation_id = f"demo-{secrets.token_hex(4)}"
    with httpx.Client(base_url=router_url.rstrip("/"), timeout=timeout_s) as http:
        reuse: list[TurnOutcome] = []
        messages = list(opening)
        for turn in range(1, turns + 1):
            if turn > 1:
                messages += [{"role": "assistant", "content": reuse[-1].text}, *later[turn - 2]]
            reuse.append(_turn(http, model, messages, turn, answer_tokens, conversation_id))
            _say(progress, f"reuse run: turn {turn}/{turns} {reuse[-1].action}")
        baseline: list[TurnOutcome] = []
        messages = list(opening)
        for turn in range(1, turns + 1):
            if turn > 1:
                messages += [{"role": "assistant", "content": reuse[turn - 2].text},
                             *later[turn - 2]]
            baseline.append(_turn(http, model, messages, turn, answer_tokens, None))
            _say(progress, f"baseline run: turn {turn}/{turns}")
    return ShowcaseResult(reuse, baseline)


def _turn(
    http: httpx.Client,
    model: str,
    messages: Sequence[dict[str, object]],
    turn: int,
    answer_tokens: int,
    conversation_id: str | None,
) -> TurnOutcome:
    body: dict[str, object] = {
        "model": model,
        "messages": list(messages),
        "max_tokens": answer_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    started = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    prompt_tokens = 0
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"router answered {resp.status_code}: {resp.text[:500]}")
        decision = decision_from_headers(resp.headers)
        action = decision.action if decision else "?"
        reason = (decision.reason if decision else None) or "?"
        reused = (decision.reused_tokens if decision else None) or 0
        for chunk in line_chunks(resp.iter_lines()):
            delta = chunk_content(chunk)
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                parts.append(delta)
            usage = usage_of(chunk)
            if usage is not None:
                prompt_tokens = usage.prompt_tokens or 0
    return TurnOutcome(turn, prompt_tokens, action, reason, reused,
                       ttft if ttft is not None else time.perf_counter() - started, "".join(parts))


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        print(text, file=progress, flush=True)
