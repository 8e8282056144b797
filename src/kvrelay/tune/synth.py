"""Synthetic multi-turn traces with a chosen gap distribution, in the public chat format.

``kvrelay tune-synth`` writes JSONL records ``{chat_id, parent_chat_id, timestamp,
input_length, output_length, turn, type, hash_ids}`` (16-token blocks), ordered by
timestamp, for tests, demos and replays (docs/tune.md, "Synthetic traces").

The generative model, all from one seed:

* conversations arrive as a Poisson process (``conversations_per_s``);
* a conversation has ``1 + Geometric`` turns with mean ``turns_mean`` (at most
  ``max_turns``; it also ends before its prompt would pass ``max_context_tokens``);
* turn 1's prompt is ``system_tokens`` + a user message; each later prompt is the previous
  prompt + its answer + a new message (append-only, so the history is a prefix);
  message and answer lengths are log-normal with medians ``user_tokens`` /
  ``output_tokens`` and log-space sigma ``length_sigma``;
* the gap from a turn's end to the next turn is a mixture: with probability
  ``tool_fraction`` a tool-call pause, else a human pause, each log-normal given by its median
  and 90th percentile (defaults: tool p50 0.3 s / p90 13.6 s, human p50 84 s / p90 1236 s,
  the coding-agent measurements quoted in docs/tune.md); a turn ends
  ``output_length * decode_s_per_token`` after it arrives (default 0);
* ``duration_s`` (optional) keeps only the turns that arrive before it, like a trace
  recorded over a window: with arrivals spread over the window, the middle of it is close to
  a steady state;
* ``hash_ids``: block ``j`` of conversation ``c`` is ``c * 2**20 + j`` (so a prefix of the
  history has the same ids in every later turn); a prompt's last, partial block gets an id
  of its own.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: z-score of the 90th percentile of a standard normal.
Z90 = 1.2815515655446004
_BLOCKS_PER_CONVERSATION = 1 << 20
_PARTIAL_BASE = 1 << 41


@dataclass(frozen=True)
class LogNormalPause:
    """A log-normal pause given by its median and 90th percentile (seconds)."""

    median_s: float
    p90_s: float

    def __post_init__(self) -> None:
        if not 0 < self.median_s <= self.p90_s:
            raise ValueError("need 0 < median_s <= p90_s")

    @property
    def sigma(self) -> float:
        return math.log(self.p90_s / self.median_s) / Z90

    def sample(self, rng: random.Random) -> float:
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))

    def cdf(self, x_s: float) -> float:
        if x_s <= 0:
            return 0.0
        if self.sigma == 0:
            return 1.0 if x_s >= self.median_s else 0.0
        z = math.log(x_s / self.median_s) / self.sigma
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


@dataclass(frozen=True)
class GapMixture:
    """Pauses between turns: tool calls with probability ``tool_fraction``, else humans."""

    tool_fraction: float = 0.7
    tool: LogNormalPause = field(default_factory=lambda: LogNormalPause(0.3, 13.6))
    human: LogNormalPause = field(default_factory=lambda: LogNormalPause(84.0, 1236.0))

    def __post_init__(self) -> None:
        if not 0 <= self.tool_fraction <= 1:
            raise ValueError("tool_fraction must be in [0, 1]")

    def sample(self, rng: random.Random) -> float:
        pause = self.tool if rng.random() < self.tool_fraction else self.human
        return pause.sample(rng)

    def cdf(self, x_s: float) -> float:
        """P(gap <= x_s)."""
        return (self.tool_fraction * self.tool.cdf(x_s)
                + (1 - self.tool_fraction) * self.human.cdf(x_s))

    def scaled(self, factor: float) -> GapMixture:
        """The same mixture with every pause ``factor`` times longer."""
        return GapMixture(
            self.tool_fraction,
            LogNormalPause(self.tool.median_s * factor, self.tool.p90_s * factor),
            LogNormalPause(self.human.median_s * factor, self.human.p90_s * factor),
        )


@dataclass(frozen=True)
class SynthSpec:
    """What ``synth_trace`` generates (module docstring)."""

    conversations: int = 2000
    seed: int = 0
    conversations_per_s: float = 0.5
    turns_mean: float = 6.0
    max_turns: int = 64
    system_tokens: int = 1000
    user_tokens: int = 150
    output_tokens: int = 250
    length_sigma: float = 0.5
    max_context_tokens: int = 32000
    gaps: GapMixture = field(default_factory=GapMixture)
    decode_s_per_token: float = 0.0
    block_tokens: int = 16
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns_mean < 1 or self.max_turns < 1:
            raise ValueError("need conversations >= 1, turns_mean >= 1 and max_turns >= 1")
        if not 0 < self.conversations_per_s < math.inf or self.block_tokens < 1:  # NaN too
            raise ValueError("conversations_per_s must be a positive finite number and "
                             "block_tokens positive")
        for name in ("length_sigma", "decode_s_per_token"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if min(self.system_tokens, self.user_tokens, self.output_tokens) < 1:
            raise ValueError("token sizes must be >= 1")
        if self.length_sigma < 0 or self.decode_s_per_token < 0:
            raise ValueError("length_sigma and decode_s_per_token must be >= 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "gaps"}
        g = self.gaps
        out["gaps"] = {"tool_fraction": g.tool_fraction,
                       "tool": {"median_s": g.tool.median_s, "p90_s": g.tool.p90_s},
                       "human": {"median_s": g.human.median_s, "p90_s": g.human.p90_s}}
        return out


@dataclass(frozen=True, slots=True)
class _Turn:
    at_s: float
    conversation: int
    turn: int
    input_tokens: int
    output_tokens: int


def synth_trace(spec: SynthSpec) -> Iterator[dict[str, Any]]:
    """The trace's records in timestamp order (chat ids numbered in that order); with
    ``duration_s``, only the turns that arrive before it (a recording window)."""
    end = math.inf if spec.duration_s is None else spec.duration_s
    turns = sorted((t for t in _turns(spec) if t.at_s < end),
                   key=lambda t: (t.at_s, t.conversation, t.turn))
    last_chat: dict[int, int] = {}
    for chat_id, t in enumerate(turns):
        full = t.input_tokens // spec.block_tokens
        base = t.conversation * _BLOCKS_PER_CONVERSATION
        hash_ids = list(range(base, base + full))
        if t.input_tokens % spec.block_tokens:
            hash_ids.append(_PARTIAL_BASE + chat_id)
        yield {
            "chat_id": chat_id,
            "parent_chat_id": last_chat.get(t.conversation, -1),
            "timestamp": t.at_s,
            "input_length": t.input_tokens,
            "output_length": t.output_tokens,
            "turn": t.turn,
            "type": "text",
            "hash_ids": hash_ids,
        }
        last_chat[t.conversation] = chat_id


def write_trace(spec: SynthSpec, path: str | Path) -> int:
    """Write ``synth_trace(spec)`` as JSONL; returns the number of records."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for record in synth_trace(spec):
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            n += 1
    return n


def _turns(spec: SynthSpec) -> Iterator[_Turn]:
    rng = random.Random(f"tune-synth/{spec.seed}")
    start = 0.0
    # P(another turn) for 1 + Geometric turns with the given mean
    more = 1.0 - 1.0 / spec.turns_mean
    for conv in range(spec.conversations):
        start += rng.expovariate(spec.conversations_per_s)
        at = start
        prompt = spec.system_tokens + _length(rng, spec.user_tokens, spec.length_sigma)
        for number in range(1, spec.max_turns + 1):
            output = _length(rng, spec.output_tokens, spec.length_sigma)
            yield _Turn(round(at, 3), conv, number, prompt, output)
            if rng.random() >= more:
                break
            nxt = prompt + output + _length(rng, spec.user_tokens, spec.length_sigma)
            if nxt > spec.max_context_tokens:
                break
            at += output * spec.decode_s_per_token + spec.gaps.sample(rng)
            prompt = nxt


def _length(rng: random.Random, median: int, sigma: float) -> int:
    return max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))

