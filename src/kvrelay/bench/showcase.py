"""One agent conversation through a router that reuses KV and through one that never does.

``make demo`` runs this because it answers the user's question in one table: per turn, what
the reusing router decided, how many prompt tokens P did not recompute, and the TTFT with
and without reuse. The comparison is built so that nothing but reuse can explain the gap:

* **Two routers, one cluster.** ``reuse_url`` is a router with its usual policy;
  ``baseline_url`` one that never pulls (``kvrelay demo`` starts it with a pull cost factor
  no pull can pay, so every follow-up is recomputed, ``cost_model``). Same engines, same
  relay hops, same messages.
* **Both paths warm.** Before anything is timed, a short conversation goes through each
  router (P's and D's first requests, the first NIXL pull, each router's first turns).
* **Order cannot bias it.** The conversation runs in ``pairs`` pairs, each with its own
  text; within a pair both routers get identical messages (the second replays the first's
  answers, so the histories are equal byte for byte), and the pairs alternate which router
  goes first (``recompute_first`` makes the baseline open). Whatever the first run of a
  pair leaves behind (D's prefix cache, a warmer page cache) helps each side equally often.
* **A ratio with its spread.** Per pair, the follow-up TTFT (turns 2..n, summed) without
  reuse over with reuse; ``summary`` gives the median and the range over pairs.

Greedy decoding makes both runs' answers equal unless reuse went wrong; the table shows it.
"""

from __future__ import annotations

import random
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TextIO

import httpx

from kvrelay.bench.client import decision_from_headers
from kvrelay.client.sse import chunk_content, line_chunks, usage_of

WORDS = ("read file grep test build error fix patch commit diff plan step tool output result "
         "line function class module import return value config retry").split()

Side = Literal["reuse", "baseline"]


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
class PairResult:
    """One conversation through both routers; ``first`` says which went first."""

    first: Side
    reuse: tuple[TurnOutcome, ...]
    baseline: tuple[TurnOutcome, ...]

    @property
    def same_output(self) -> bool:
        return [t.text for t in self.reuse] == [t.text for t in self.baseline]

    @property
    def reuse_followups_s(self) -> float:
        return sum(t.ttft_s for t in self.reuse if t.turn > 1)

    @property
    def baseline_followups_s(self) -> float:
        return sum(t.ttft_s for t in self.baseline if t.turn > 1)

    @property
    def ratio(self) -> float:
        """Follow-up TTFT without reuse over with reuse (above 1: reuse is faster)."""
        reuse = self.reuse_followups_s
        return self.baseline_followups_s / reuse if reuse > 0 else float("nan")


def pair_order(pairs: int, recompute_first: bool = False) -> list[Side]:
    """Which router opens each pair: alternating, starting with the reusing one unless
    ``recompute_first``."""
    sides: tuple[Side, Side] = ("baseline", "reuse") if recompute_first else ("reuse",
                                                                              "baseline")
    return [sides[i % 2] for i in range(pairs)]


@dataclass(frozen=True)
class ShowcaseResult:
    pairs: tuple[PairResult, ...]

    @property
    def same_output(self) -> bool:
        return all(p.same_output for p in self.pairs)

    @property
    def ratios(self) -> list[float]:
        return [p.ratio for p in self.pairs]

    def table(self) -> str:
        """Per turn: the reusing router's decisions over the pairs, median TTFTs."""
        lines = [
            "| turn | prompt tokens | decisions with reuse | reused tokens (median) | "
            "TTFT reuse (median) | TTFT no reuse (median) | same answer |",
            "|---|---|---|---|---|---|---|",
        ]
        turns = len(self.pairs[0].reuse)
        for i in range(turns):
            reuse = [p.reuse[i] for p in self.pairs]
            base = [p.baseline[i] for p in self.pairs]
            decisions: dict[str, int] = {}
            for t in reuse:
                key = f"{t.action} ({t.reason})"
                decisions[key] = decisions.get(key, 0) + 1
            shown = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in decisions.items())
            same = all(a.text == b.text for a, b in zip(reuse, base, strict=True))
            lines.append(
                f"| {i + 1} | {statistics.median(t.prompt_tokens for t in reuse):.0f} "
                f"| {shown} | {statistics.median(t.reused_tokens for t in reuse):.0f} "
                f"| {_ms(statistics.median(t.ttft_s for t in reuse))} "
                f"| {_ms(statistics.median(t.ttft_s for t in base))} | "
                f"{'yes' if same else 'NO'} |"
            )
        return "\n".join(lines)

    def pairs_table(self) -> str:
        lines = ["| pair | first | follow-up TTFT reuse | no reuse | ratio |",
                 "|---|---|---|---|---|"]
        for i, p in enumerate(self.pairs, 1):
            lines.append(f"| {i} | {p.first} | {p.reuse_followups_s:.2f} s | "
                         f"{p.baseline_followups_s:.2f} s | {p.ratio:.2f}x |")
        return "\n".join(lines)

    def summary(self) -> str:
        ratios = self.ratios
        followups = [t for p in self.pairs for t in p.reuse if t.turn > 1]
        pulled = sum(1 for t in followups if t.action == "pull")
        reused = sum(t.reused_tokens for p in self.pairs for t in p.reuse)
        total = sum(t.prompt_tokens for p in self.pairs for t in p.reuse)
        context = statistics.median(t.prompt_tokens for t in followups) if followups else 0
        median = statistics.median(ratios)
        verdict = ("reuse is faster" if min(ratios) > 1 else
                   "reuse is slower" if max(ratios) < 1 else "no clear difference")
        decided = (f"The reusing router pulled on {pulled} of {len(followups)} follow-ups"
                   + ("" if pulled == len(followups) else
                      f" and recomputed the rest ({_reasons(followups)})"))
        return (
            f"Follow-up TTFT (turns 2-{len(self.pairs[0].reuse)}, median context "
            f"{context:.0f} tokens), without reuse / with reuse: **{median:.2f}x** "
            f"(median of {len(ratios)} pairs alternated in order; range "
            f"{min(ratios):.2f}x-{max(ratios):.2f}x): {verdict}. {decided}; reuse saved "
            f"{reused} of {total} prompt tokens ({100 * reused / max(1, total):.0f}%). "
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
    reuse_url: str,
    baseline_url: str,
    model: str,
    *,
    pairs: int = 4,
    turns: int = 6,
    system_words: int = 250,
    tool_words: int = 60,
    answer_tokens: int = 16,
    recompute_first: bool = False,
    seed: int = 0,
    progress: TextIO | None = None,
    timeout_s: float = 600.0,
) -> ShowcaseResult:
    """Warm both routers, then run ``pairs`` alternated pairs (module docstring)."""
    if pairs < 1 or turns < 2:
        raise ValueError("need at least one pair and two turns")
    tag = secrets.token_hex(3)
    with httpx.Client(base_url=reuse_url.rstrip("/"), timeout=timeout_s) as reuse, \
            httpx.Client(base_url=baseline_url.rstrip("/"), timeout=timeout_s) as baseline:
        clients = {"reuse": reuse, "baseline": baseline}
        opening, later = agent_messages(2, system_words, tool_words, seed + 1000)
        for side in ("reuse", "baseline"):
            _conversation(clients[side], model, opening, later, answer_tokens,
                          f"demo-{tag}-warm-{side}", None)
            _say(progress, f"warm-up: {side} router, 2 turns")
        results: list[PairResult] = []
        for i, first in enumerate(pair_order(pairs, recompute_first)):
            opening, later = agent_messages(turns, system_words, tool_words, seed + i)
            second: Side = "baseline" if first == "reuse" else "reuse"
            runs: dict[str, list[TurnOutcome]] = {}
            runs[first] = _conversation(clients[first], model, opening, later, answer_tokens,
                                        f"demo-{tag}-{i}-{first}", None)
            runs[second] = _conversation(clients[second], model, opening, later,
                                         answer_tokens, f"demo-{tag}-{i}-{second}",
                                         [t.text for t in runs[first]])
            pair = PairResult(first, tuple(runs["reuse"]), tuple(runs["baseline"]))
            results.append(pair)
            _say(progress, f"pair {i + 1}/{pairs} ({first} first): "
                           f"{pair.reuse_followups_s:.2f} s with reuse, "
                           f"{pair.baseline_followups_s:.2f} s without ({pair.ratio:.2f}x)")
    return ShowcaseResult(tuple(results))


def _conversation(
    http: httpx.Client,
    model: str,
    opening: Sequence[dict[str, object]],
    later: Sequence[Sequence[dict[str, object]]],
    answer_tokens: int,
    conversation_id: str,
    answers: Sequence[str] | None,
) -> list[TurnOutcome]:
    """Every turn of one conversation; the history holds ``answers`` when given (a replay
    of another run's), else this run's own."""
    outcomes: list[TurnOutcome] = []
    messages = list(opening)
    for turn in range(1, len(later) + 2):
        if turn > 1:
            answer = answers[turn - 2] if answers is not None else outcomes[-1].text
            messages += [{"role": "assistant", "content": answer}, *later[turn - 2]]
        outcomes.append(_turn(http, model, messages, turn, answer_tokens, conversation_id))
    return outcomes


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


def _reasons(turns: Sequence[TurnOutcome]) -> str:
    counts: dict[str, int] = {}
    for t in turns:
        if t.action != "pull":
            counts[t.reason] = counts.get(t.reason, 0) + 1
    return ", ".join(f"{r} x{n}" for r, n in counts.items())


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        print(text, file=progress, flush=True)
