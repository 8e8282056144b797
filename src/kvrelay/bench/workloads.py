"""Multi-turn workloads: deterministic scripts of conversations, built from a seed.

A ``Workload`` is pure data: conversations, each a sequence of turns. A turn says which
messages the client appends to the history before sending it (user or tool-result text), the
``max_tokens`` of the answer, and how long the client "thinks" after the previous answer
before sending it. The assistant's answers are *not* scripted: the runner appends what the
server generated, so the next prompt starts with exactly the tokens D holds.

Planned sizes. Every turn carries ``target_tokens``, the prompt length it was built for,
assuming every earlier answer is ``max_tokens`` tokens long (``planned_history`` fills them
with placeholder text of that length). Contract for the sweep and agent generators, checked by
``tests/unit/test_bench_workloads``:
``target - BLOCK_TOKENS < count_tokens(planned_history(conv, i)) <= target``. (Replayed
turns carry the recorded prompt's length instead, see ``replay``.) The contract holds for the
agent generator's tool calls too: a tool-call turn's answer is planned like any answer, as
``max_tokens`` tokens of assistant text (``max_tokens`` then includes the call's wrapper,
``TOOL_CALL_TOKENS``), and the tool result is a ``tool`` message counted as such. It is a
plan in chat-template tokens, not the served prompt: over the Messages API the prompt also
holds the tools' definitions (a constant, ~180 tokens with ``tiny``), and a call re-sent in
the history renders as the template writes tool calls, in fewer tokens than the answer took
(the fake writes the call's wrapper one token per character: ~45 tokens fewer per call
with ``tiny``).

Tool calls. A turn with ``tool_call`` asks the client to force its answer to be a call of
the one tool (``messages_client``); the next turn then opens with the tool's result, a
``tool`` message (``bench.tool_calls`` says how the runner ties it to the call's id).

Determinism: equal arguments (``seed``, ``salt``, sizes, the counter) give equal workloads.
The ``salt`` opens every conversation's first message, so two runs with different salts
share no KV block (prefix caches cannot serve one run from the other).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvrelay.bench.tokens import ChatMessage, CountTokens

#: vLLM's KV block size: the precision the token targets are held to.
BLOCK_TOKENS = 128
#: What a tool-call turn's ``max_tokens`` adds to the answer's tokens for the call's wrapper.
#: The fake engine writes a forced call of the tool ``run`` as ``<tool_call>{"name": "run",
#: "arguments": {"input": "`` + the answer + ``"}}</tool_call>``, the wrapper one token per
#: character: 66 tokens (``tests/unit/test_bench_workloads`` checks it fits); a call cut off
#: before its end is no call.
TOOL_CALL_TOKENS = 80

WorkloadKind = Literal["sweep", "agent", "replay"]
ThinkKind = Literal["constant", "exponential", "lognormal", "uniform"]

_WORDS: tuple[str, ...] = tuple((
    "agent tool call result file error retry plan step search query answer context token "
    "cache block node prefill decode model router vector stream turn patch diff test build "
    "deploy config schema index table column value request response header status latency "
    "trace span metric queue worker thread memory buffer socket path module function class"
).split())


class WorkloadError(ValueError):
    """A workload that cannot be built as asked (e.g. a target below the fixed overhead)."""


@dataclass(frozen=True)
class ThinkTime:
    """Think-time distribution between turns, in seconds, with mean ``mean_s``.

    ``exponential``: memoryless, long tail (``P(X > t) = exp(-t / mean)``); ``lognormal``:
    ``sigma`` is the log-space standard deviation, ``mu = ln(mean) - sigma**2 / 2`` so the
    mean is exact; ``uniform``: on ``[0, 2 * mean]``; ``constant``: always ``mean``.
    ``max_s``: samples above it are cut to it (``None``: none are), so a heavy tail far
    beyond every TTL does not stretch a benchmark's wall time (``mean_s`` is then the mean
    before the cut).
    """

    kind: ThinkKind = "exponential"
    mean_s: float = 5.0
    sigma: float = 1.0
    max_s: float | None = None

    def __post_init__(self) -> None:
        if self.mean_s < 0 or self.sigma < 0:
            raise WorkloadError("think time mean and sigma must be >= 0")
        if self.max_s is not None and self.max_s < 0:
            raise WorkloadError("think time max_s must be >= 0")
        if self.kind not in ("constant", "exponential", "lognormal", "uniform"):
            raise WorkloadError(f"unknown think-time distribution {self.kind!r}")

    def sample(self, rng: random.Random) -> float:
        value = self._draw(rng)
        return value if self.max_s is None else min(value, self.max_s)

    def _draw(self, rng: random.Random) -> float:
        if self.mean_s == 0 or self.kind == "constant":
            return self.mean_s
        if self.kind == "exponential":
            return rng.expovariate(1.0 / self.mean_s)
        if self.kind == "uniform":
            return rng.uniform(0.0, 2.0 * self.mean_s)
        mu = math.log(self.mean_s) - self.sigma**2 / 2
        return rng.lognormvariate(mu, self.sigma)


@dataclass(frozen=True)
class Pacing:
    """When an open-loop workload's conversations start and how its clients think: starts
    are a Poisson process with mean gap ``arrival_mean_s`` (0: all at once), every turn after
    a conversation's first waits ``think``, and at most ``concurrency`` conversations run at
    a time (``None``: all of them)."""

    think: ThinkTime = field(default_factory=ThinkTime)
    arrival_mean_s: float = 1.0
    concurrency: int | None = None

    def starts(self, kind: str, seed: int) -> Iterator[float]:
        """Start times of successive conversations, the first at 0, reproducible from
        ``kind`` and ``seed``."""
        rng = random.Random(f"{kind}-arrivals/{seed}")
        start = 0.0
        while True:
            yield start
            if self.arrival_mean_s > 0:
                start += rng.expovariate(1.0 / self.arrival_mean_s)

    def params(self) -> dict[str, object]:
        """The pacing as a workload's ``params`` record it."""
        return {"think": self.think.kind, "think_mean_s": self.think.mean_s,
                "think_sigma": self.think.sigma, "arrival_mean_s": self.arrival_mean_s,
                **({} if self.think.max_s is None else {"think_max_s": self.think.max_s})}


@dataclass(frozen=True)
class TurnSpec:
    """One request: append ``new_messages``, wait ``think_s`` (from the previous answer's end;
    ignored for the first turn), send with ``max_tokens``. ``measured`` marks the turns a
    report focuses on (the sweep's follow-up). ``tool_call``: the client forces the answer
    to be a tool call (the next turn's ``new_messages`` then start with its ``tool`` result,
    and its ``think_s`` is the tool's execution time)."""

    new_messages: tuple[ChatMessage, ...]
    max_tokens: int
    think_s: float = 0.0
    target_tokens: int = 0
    measured: bool = True
    tool_call: bool = False


@dataclass(frozen=True)
class ConversationSpec:
    """A scripted conversation. ``start_s``: when it starts, from the run's start.
    ``context_tokens``: the sweep length it belongs to (``None`` outside sweeps)."""

    conversation_id: str
    turns: tuple[TurnSpec, ...]
    start_s: float = 0.0
    context_tokens: int | None = None


@dataclass(frozen=True)
class Workload:
    """Conversations plus how many may run at once (``1`` = one after another)."""

    kind: WorkloadKind
    conversations: tuple[ConversationSpec, ...]
    concurrency: int = 1
    params: dict[str, object] = field(default_factory=dict)

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def placeholder_answer(num_tokens: int, count: CountTokens) -> str:
    """Text whose content is ``num_tokens`` tokens as an assistant message (at most that)."""
    build = appending((), "assistant")
    return fill_text(build, count, count(build("")) + num_tokens, random.Random(num_tokens))


def planned_history(conv: ConversationSpec, turn: int, count: CountTokens) -> list[ChatMessage]:
    """The prompt of turn ``turn`` (0-based) if every earlier answer were ``max_tokens`` long."""
    history: list[ChatMessage] = []
    for i, spec in enumerate(conv.turns[: turn + 1]):
        if i > 0:
            answer = placeholder_answer(conv.turns[i - 1].max_tokens, count)
            history.append({"role": "assistant", "content": answer})
        history.extend(spec.new_messages)
    return history


def appending(
    prefix: Sequence[ChatMessage],
    role: str,
    head: str = "",
    suffix: Sequence[ChatMessage] = (),
) -> Callable[[str], list[ChatMessage]]:
    """``text -> [*prefix, {role, head + text}, *suffix]``: what ``fill_text`` sizes."""
    before, after = list(prefix), list(suffix)

    def build(text: str) -> list[ChatMessage]:
        return [*before, {"role": role, "content": head + text}, *after]

    return build


def fill_text(
    build: Callable[[str], Sequence[ChatMessage]],
    count: CountTokens,
    target: int,
    rng: random.Random,
) -> str:
    """The longest prefix of a seeded word stream with ``count(build(text)) <= target``.

    Galloping, then binary search over the number of words (assumes the count grows with the
    text); every word adds at least one token, so the result is below ``target`` by at most
    one word's tokens (plus one separator). Raises
    ``WorkloadError`` if even the empty text exceeds ``target``.
    """
    base = count(build(""))
    if base > target:
        raise WorkloadError(f"target of {target} tokens is below the fixed overhead ({base})")
    words = _word_stream(rng, target - base)
    lo, hi = 0, len(words)  # invariant: count(build(join(words[:lo]))) <= target
    step = 1
    while lo + step < hi:  # gallop first: probes stay below twice the target's text
        if count(build(" ".join(words[: lo + step]))) > target:
            hi = lo + step - 1
            break
        lo += step
        step *= 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(" ".join(words[:mid]))) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _word_stream(rng: random.Random, max_words: int) -> list[str]:
    out: list[str] = []
    for i in range(max_words):
        if i % 17 == 16:
            out.append(f"{rng.randrange(10_000)}.")
        else:
            out.append(rng.choice(_WORDS))
    return out


def _opening(salt: str, seed: int, index: int, kind: str) -> str:
    return f"[{kind} session {salt}-{seed}-{index}] You are an agent. Work step by step.\n"


def sweep_workload(
    count: CountTokens,
    *,
    lengths: Sequence[int] = (2048, 4096, 8192, 16384, 24576),
    conversations_per_length: int = 3,
    setup_answer_tokens: int = 32,
    followup_tokens: int = 64,
    followup_answer_tokens: int = 16,
    gap_s: float = 1.0,
    seed: int = 0,
    salt: str = "",
) -> Workload:
    """The context sweep: per length ``L``, conversations of two turns, run one at a time.

    Turn 1 sends a system prompt and one long user message (the history); turn 2 (the
    follow-up, the measured turn) appends the answer and a ``followup_tokens`` user message,
    so its planned prompt is ``L`` tokens (within one block, see the module contract).
    The follow-up waits ``gap_s`` after turn 1's answer, so D's report of the retained KV has
    reached the router (``0``: back to back, the router may wait for the report).
    """
    if gap_s < 0:
        raise WorkloadError("gap_s must be >= 0")
    if conversations_per_length < 1 or not lengths:
        raise WorkloadError("a sweep needs at least one length and one conversation per length")
    answer: ChatMessage = {
        "role": "assistant", "content": placeholder_answer(setup_answer_tokens, count)
    }
    convs: list[ConversationSpec] = []
    for length in lengths:
        for rep in range(conversations_per_length):
            rng = random.Random(f"sweep/{seed}/{length}/{rep}")
            system: ChatMessage = {
                "role": "system", "content": _opening(salt, seed, len(convs), "sweep")
            }
            ask = appending((), "user", "Next step: ")
            followup = ask(fill_text(ask, count, count(ask("")) + followup_tokens, rng))[0]
            build = appending([system], "user", suffix=[answer, followup])
            first = [system, build(fill_text(build, count, length, rng))[1]]
            convs.append(ConversationSpec(
                conversation_id=f"sweep-{length}-{rep}",
                turns=(
                    TurnSpec(tuple(first), setup_answer_tokens, target_tokens=count(first),
                             measured=False),
                    TurnSpec((followup,), followup_answer_tokens, think_s=gap_s,
                             target_tokens=length),
                ),
                context_tokens=length,
            ))
    return Workload("sweep", tuple(convs), concurrency=1, params={
        "lengths": list(lengths), "conversations_per_length": conversations_per_length,
        "setup_answer_tokens": setup_answer_tokens, "followup_tokens": followup_tokens,
        "followup_answer_tokens": followup_answer_tokens, "gap_s": gap_s, "seed": seed,
        "salt": salt,
    })


#: The default tool execution time (workload seconds): lognormal, mean 8 s, sigma 1.5, cut
#: at a 120 s tool timeout (Claude Code's Bash tool's default).
TOOL_TIME = ThinkTime("lognormal", 8.0, 1.5, 120.0)


def agent_workload(
    count: CountTokens,
    *,
    conversations: int = 16,
    turns: int = 10,
    system_tokens: int = 1024,
    user_tokens: int = 150,
    answer_tokens: int = 300,
    pacing: Pacing | None = None,
    abandon_p: float = 0.0,
    tool_p: float = 0.0,
    tool_time: ThinkTime | None = None,
    seed: int = 0,
    salt: str = "",
    shared_system_tokens: int = 0,
) -> Workload:
    """Agent sessions: ``conversations`` concurrent loops of ``turns`` turns each.

    ``shared_system_tokens``: of the ``system_tokens``, about this many at the start are the
    same in every conversation of the workload (an agent's system prompt and tools, which
    real harnesses send unchanged with every session; D's prefix cache holds them once):
    drawn from the salt alone, so another salt (another run, the retention benchmark's
    prelude) shares nothing with this one. 0: every system prompt is the conversation's own
    from its first token.

    Turn 1's prompt is a ``system_tokens`` system prompt plus a ``user_tokens`` task; every
    later turn appends the previous answer (its ``max_tokens``) and ``user_tokens`` more.
    The planned prompt of turn ``k`` (1-based) is ``system_tokens + k * user_tokens`` plus
    the ``max_tokens`` of turns ``1 .. k-1``: each new message absorbs the template tokens,
    so the error never accumulates. Think times, arrivals and concurrency come from
    ``pacing`` (``Pacing()`` when ``None``).

    ``tool_p``: each turn's answer is a tool call (``TurnSpec.tool_call``, ``max_tokens =
    answer_tokens + TOOL_CALL_TOKENS``) with this probability, drawn from a seeded stream of
    its own; the next turn appends the tool's result (a ``tool`` message of ``user_tokens``,
    ``Tool result:\n...``) after a gap drawn from ``tool_time`` (``TOOL_TIME`` when
    ``None``; a stream of its own), not a think time. After a reply (no tool call) the next
    turn is a user task (``Task: ...``) after a think time. With ``tool_p = 0`` the workload
    is exactly the one this function built before it modelled tools: no tool calls, every
    later turn a user message, turns 2, 4, ... reading as tool results, the others as tasks.

    ``abandon_p``: after each turn but the last, the conversation is abandoned (its later
    turns are never sent) with this probability, drawn from a seeded stream of its own:
    after a reply the user never comes back; after a tool call the harness was stopped (the
    user interrupted the loop, the agent's process ended). Conversations have
    ``min(turns, Geometric(abandon_p))`` turns, whatever ``tool_p``; the turns kept are the
    same as with ``abandon_p = 0`` (abandoned sessions: their last turn's KV is never read
    again, what retention has to find out).
    """
    if not 0.0 <= abandon_p < 1.0:
        raise WorkloadError("abandon_p is a probability in [0, 1)")
    if not 0.0 <= tool_p <= 1.0:
        raise WorkloadError("tool_p is a probability in [0, 1]")
    pacing = pacing or Pacing()
    tool_time = tool_time or TOOL_TIME
    if conversations < 1 or turns < 1:
        raise WorkloadError("agent sessions need at least one conversation and one turn")
    if pacing.arrival_mean_s < 0:
        raise WorkloadError("arrival_mean_s must be >= 0")
    think = pacing.think
    if not 0 <= shared_system_tokens <= system_tokens:
        raise WorkloadError("shared_system_tokens must be within [0, system_tokens]")
    shared = ""
    if shared_system_tokens:
        shared = fill_text(appending((), "system"), count, shared_system_tokens,
                           random.Random(f"agent-shared-system/{salt}")) + "\n"
    answers: dict[int, ChatMessage] = {}

    def answer(max_tokens: int) -> ChatMessage:
        if max_tokens not in answers:
            answers[max_tokens] = {"role": "assistant",
                                   "content": placeholder_answer(max_tokens, count)}
        return answers[max_tokens]

    starts = pacing.starts("agent", seed)
    convs: list[ConversationSpec] = []
    for index in range(conversations):
        rng = random.Random(f"agent/{seed}/{index}")
        tools = random.Random(f"agent-tools/{seed}/{index}")
        tool_gaps = random.Random(f"agent-tool-time/{seed}/{index}")
        opening = appending((), "system", shared + _opening(salt, seed, index, "agent"))
        history = opening(fill_text(opening, count, system_tokens, rng))
        specs: list[TurnSpec] = []
        target = system_tokens
        for k in range(1, turns + 1):
            after_tool = k > 1 and specs[-1].tool_call
            if k > 1:
                history.append(answer(specs[-1].max_tokens))
                target += specs[-1].max_tokens
            target += user_tokens
            if after_tool:
                build = appending(history, "tool", "Tool result:\n")
            else:
                untooled = tool_p == 0 and k % 2 == 0
                build = appending(history, "user", "Tool result:\n" if untooled else "Task: ")
            history = build(fill_text(build, count, target, rng))
            gap = (tool_time.sample(tool_gaps) if after_tool
                   else think.sample(rng) if k > 1 else 0.0)
            tool_call = tools.random() < tool_p
            specs.append(TurnSpec(
                tuple(history) if k == 1 else (history[-1],),
                answer_tokens + (TOOL_CALL_TOKENS if tool_call else 0),
                think_s=gap,
                target_tokens=target,
                tool_call=tool_call,
            ))
        kept = 1
        abandon = random.Random(f"agent-abandon/{seed}/{index}")
        while kept < turns and not (abandon_p > 0 and abandon.random() < abandon_p):
            kept += 1
        convs.append(ConversationSpec(f"agent-{index}", tuple(specs[:kept]),
                                      start_s=next(starts)))
    tool_params: dict[str, object] = {
        "tool_p": tool_p, "tool_time": tool_time.kind, "tool_mean_s": tool_time.mean_s,
        "tool_sigma": tool_time.sigma, "tool_call_tokens": TOOL_CALL_TOKENS,
        **({} if tool_time.max_s is None else {"tool_max_s": tool_time.max_s})}
    return Workload("agent", tuple(convs), concurrency=pacing.concurrency or conversations,
                    params={
        "conversations": conversations, "turns": turns, "abandon_p": abandon_p,
        "system_tokens": system_tokens,
        **({"shared_system_tokens": shared_system_tokens} if shared_system_tokens else {}),
        "user_tokens": user_tokens, "answer_tokens": answer_tokens, **pacing.params(),
        **tool_params, "seed": seed, "salt": salt,
    })
