"""The retention benchmark's arithmetic: per-mode figures and issue #21's goals (pure).

``kvrelay bench retention`` (``bench.retention_bench``) runs one workload through three
modes (``managed``: kvrelay's retention; ``stock``: vLLM's global TTL; ``none``: no
bidirectional transfer, D retains nothing) and records, per mode, the client's turns and a
sampled trace of D. This module turns them into figures and checks the goals:

* **new-conversation TTFT**: turn 1 of each conversation (its TTFT is where D's admission
  waits for blocks shows: a decode request that does not fit waits); p50 and p99;
* **follow-up hit rate**: turns >= 2 that succeeded and pulled (action ``pull`` with reused
  tokens > 0), over all turns >= 2 that succeeded; beside it the same rate split by what the
  follow-up continued (``TurnRecord.after_tool_call``): *after a tool call* (the harness came
  back with the tool's result after its execution time) and *after a reply* (the user came
  back after a think time). The two split counts add up to the overall ones;
* **tool-call turns**: turns that forced a tool call, and how many of their answers made one
  (a call cut off by ``max_tokens`` is none; its follow-up counts as after a reply);
* **retained block-seconds**: the integral of D's held blocks over the sampled span (a step
  function: each sample holds until the next), times the time scale, so the figure is in
  the workload's (unscaled) seconds;
* **misses by cause**: each follow-up that did not pull, by why its turn was gone: D released
  it (``released/pressure``, ``released/headroom``, ``released/router``; the router's
  ``X-KVRelay-Released-Cause``, ``released/releasing`` while D's ask was not yet told), its
  retention ran out (``expired``), or the router had no entry (``no_entry``); other reasons
  as the router gave them. Beside D's releases by cause, this shows why hits are lost;
  and beside the misses D caused by choosing (``released/pressure``, ``released/headroom``)
  the number it expected (``expected_lost``: the sum, over the turns it chose, of their
  chance of a pull when it chose them, ``RetainedTurn.pull_chance``; a turn without a
  return curve counts 1): a count close to it says the turns released were as unlikely to
  be pulled as D's curves said, a count well above it that the curves are wrong;
* **preemptions**: D's ``num_preemptions`` over the run. D's cache is sized so that live
  work alone does not preempt; the ``none`` mode measures that, and a mode's preemptions
  *caused by retention* are its count above ``none``'s.

Goals (issue #21): managed's new-conversation TTFT p99 at most 1.1x none's; managed's hit
rate at least stock's; managed's block-seconds at most half stock's; managed's preemptions
caused by retention 0. A goal whose inputs are missing (a mode not run, no follow-up) is
``met=None``, never passed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvrelay.bench.metrics import TurnRecord, percentile

TTFT_RATIO_GOAL = 1.1
CHOSEN_CAUSES = ("pressure", "headroom")
"""The releases whose turns D chose (the others are the router's or the deadline's)."""
BLOCK_SECONDS_RATIO_GOAL = 0.5


@dataclass(frozen=True)
class DecodeTrace:
    """What the sampler saw of one mode's D: ``(seconds since the run started, held
    blocks, waiting requests)`` samples, when sampling ended, D's preemptions and releases
    by cause, and per cause the sum of the released turns' chances of a pull when D chose
    them (both empty without kvrelay's retention)."""

    samples: tuple[tuple[float, int, int], ...]
    end_s: float
    num_preemptions: int
    releases: Mapping[str, int] = field(default_factory=dict)
    released_pull_chance: Mapping[str, float] = field(default_factory=dict)


def block_seconds(samples: Sequence[tuple[float, int, int]], end_s: float) -> float:
    """Integral of held blocks over ``[first sample, end_s]``, each sample holding until the
    next (0 without a sample before ``end_s``)."""
    points = sorted((t, blocks) for t, blocks, _ in samples if t < end_s)
    total = 0.0
    for i, (t, blocks) in enumerate(points):
        nxt = points[i + 1][0] if i + 1 < len(points) else end_s
        total += blocks * (nxt - t)
    return total


@dataclass(frozen=True)
class RetentionSummary:
    """One mode's figures (module docstring); times in seconds, block-seconds in workload
    seconds (real seconds x ``time_scale``)."""

    mode: str
    conversations: int
    failed_turns: int
    new_ttft_p50_s: float | None
    new_ttft_p99_s: float | None
    followups: int
    pulled: int
    hit_rate: float | None
    block_seconds: float
    peak_blocks: int
    peak_waiting: int
    preemptions: int
    releases: dict[str, int]
    followup_reasons: dict[str, int]
    misses: dict[str, int] = field(default_factory=dict)
    expected_lost: float | None = None
    tool_call_turns: int = 0
    tool_calls_made: int = 0
    followups_after_tool: int = 0
    pulled_after_tool: int = 0
    hit_rate_after_tool: float | None = None
    followups_after_reply: int = 0
    pulled_after_reply: int = 0
    hit_rate_after_reply: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize_retention(
    mode: str, records: Sequence[TurnRecord], trace: DecodeTrace, time_scale: float
) -> RetentionSummary:
    """The ``RetentionSummary`` of one mode's records and D trace."""
    if not time_scale > 0:
        raise ValueError("time_scale must be > 0")
    ok = [r for r in records if r.succeeded]
    firsts = [r.ttft_s for r in ok if r.turn == 1 and r.ttft_s is not None]
    followups = [r for r in ok if r.turn >= 2]
    pulled = sum(1 for r in followups if _pulled(r))
    reasons = Counter(f"{r.action}/{r.reason}" for r in followups)
    misses = Counter(miss_cause(r) for r in followups if not _pulled(r))
    after_tool = [r for r in followups if r.after_tool_call]
    after_reply = [r for r in followups if not r.after_tool_call]
    pulled_tool = sum(1 for r in after_tool if _pulled(r))
    pulled_reply = pulled - pulled_tool
    return RetentionSummary(
        mode=mode,
        conversations=len({r.conversation_id for r in records}),
        failed_turns=len(records) - len(ok),
        new_ttft_p50_s=percentile(firsts, 50) if firsts else None,
        new_ttft_p99_s=percentile(firsts, 99) if firsts else None,
        followups=len(followups),
        pulled=pulled,
        hit_rate=pulled / len(followups) if followups else None,
        block_seconds=block_seconds(trace.samples, trace.end_s) * time_scale,
        peak_blocks=max((b for _, b, _ in trace.samples), default=0),
        peak_waiting=max((w for _, _, w in trace.samples), default=0),
        preemptions=trace.num_preemptions,
        releases={k: v for k, v in sorted(trace.releases.items()) if v},
        followup_reasons=dict(sorted(reasons.items())),
        misses=dict(sorted(misses.items())),
        expected_lost=sum(trace.released_pull_chance.get(c, 0.0) for c in CHOSEN_CAUSES)
        if trace.released_pull_chance else None,
        tool_call_turns=sum(1 for r in records if r.tool_call),
        tool_calls_made=sum(1 for r in records if r.made_tool_call),
        followups_after_tool=len(after_tool),
        pulled_after_tool=pulled_tool,
        hit_rate_after_tool=pulled_tool / len(after_tool) if after_tool else None,
        followups_after_reply=len(after_reply),
        pulled_after_reply=pulled_reply,
        hit_rate_after_reply=pulled_reply / len(after_reply) if after_reply else None,
    )


def miss_cause(record: TurnRecord) -> str:
    """Why a follow-up did not pull (module docstring, "misses by cause")."""
    reason = record.reason or record.action or "unknown"
    if reason == "released":
        return f"released/{record.released_cause or 'unknown'}"
    return reason


def _pulled(record: TurnRecord) -> bool:
    return record.action == "pull" and (record.reused_tokens or 0) > 0


@dataclass(frozen=True)
class GoalCheck:
    """One goal: what was measured (a ratio or a count), the target, and whether it holds
    (``None``: not measurable in this run)."""

    goal: str
    measured: float | None
    target: str
    met: bool | None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def check_goals(summaries: Mapping[str, RetentionSummary]) -> list[GoalCheck]:
    """Issue #21's four goals for ``managed`` against ``stock`` and ``none``."""
    managed, stock, none = (summaries.get(m) for m in ("managed", "stock", "none"))
    ttft = _ratio(managed.new_ttft_p99_s if managed else None,
                  none.new_ttft_p99_s if none else None)
    hit_m = managed.hit_rate if managed else None
    hit_s = stock.hit_rate if stock else None
    blocks = _ratio(managed.block_seconds if managed else None,
                    stock.block_seconds if stock else None)
    caused = (managed.preemptions - none.preemptions) if managed and none else None
    return [
        GoalCheck("new-conversation TTFT p99, managed / none", ttft,
                  f"<= {TTFT_RATIO_GOAL:g}", None if ttft is None else ttft <= TTFT_RATIO_GOAL),
        GoalCheck("follow-up hit rate, managed - stock",
                  None if hit_m is None or hit_s is None else hit_m - hit_s, ">= 0",
                  None if hit_m is None or hit_s is None else hit_m >= hit_s),
        GoalCheck("retained block-seconds, managed / stock", blocks,
                  f"<= {BLOCK_SECONDS_RATIO_GOAL:g}",
                  None if blocks is None else blocks <= BLOCK_SECONDS_RATIO_GOAL),
        GoalCheck("preemptions caused by retention (managed - none)",
                  None if caused is None else float(caused), "0",
                  None if caused is None else caused <= 0),
    ]


def markdown_table(summaries: Mapping[str, RetentionSummary],
                   goals: Sequence[GoalCheck]) -> list[str]:
    """The modes side by side, then the goals (TTFT in ms)."""
    modes = list(summaries.values())

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:,.0f}"

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    rows: list[tuple[str, list[str]]] = [
        ("conversations", [str(s.conversations) for s in modes]),
        ("failed turns", [str(s.failed_turns) for s in modes]),
        ("new-conversation TTFT p50 (ms)", [ms(s.new_ttft_p50_s) for s in modes]),
        ("new-conversation TTFT p99 (ms)", [ms(s.new_ttft_p99_s) for s in modes]),
        ("follow-ups", [str(s.followups) for s in modes]),
        ("follow-up hit rate", [f"{pct(s.hit_rate)} ({s.pulled})" for s in modes]),
        ("hit rate after a tool call", [
            f"{pct(s.hit_rate_after_tool)} ({s.pulled_after_tool}/{s.followups_after_tool})"
            for s in modes]),
        ("hit rate after a reply", [
            f"{pct(s.hit_rate_after_reply)} ({s.pulled_after_reply}/{s.followups_after_reply})"
            for s in modes]),
        ("tool-call turns (calls made)", [f"{s.tool_call_turns} ({s.tool_calls_made})"
                                          for s in modes]),
        ("retained block-seconds", [f"{s.block_seconds:,.0f}" for s in modes]),
        ("peak retained blocks", [str(s.peak_blocks) for s in modes]),
        ("peak waiting requests on D", [str(s.peak_waiting) for s in modes]),
        ("D preemptions", [str(s.preemptions) for s in modes]),
        ("D releases by cause", [_counts(s.releases) for s in modes]),
        ("follow-ups by action/reason", [_counts(s.followup_reasons) for s in modes]),
        ("follow-up misses by cause", [_counts(s.misses) for s in modes]),
        ("misses D chose / expected", [
            "-" if s.expected_lost is None else
            f"{sum(s.misses.get(f'released/{c}', 0) for c in CHOSEN_CAUSES)} / "
            f"{s.expected_lost:.2f}" for s in modes]),
    ]
    lines = ["| | " + " | ".join(s.mode for s in modes) + " |",
             "|---|" + "---|" * len(modes)]
    lines += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows]
    lines += ["", "| goal | measured | target | met |", "|---|---|---|---|"]
    for g in goals:
        measured = "-" if g.measured is None or math.isnan(g.measured) else f"{g.measured:.3g}"
        met = "n/a" if g.met is None else ("yes" if g.met else "**no**")
        lines.append(f"| {g.goal} | {measured} | {g.target} | {met} |")
    return lines


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
