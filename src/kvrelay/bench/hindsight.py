"""What a decode node that knew the future would have had to hold: live requests plus the
turns still to be continued, and the follow-ups no D of that size could keep without making
live work wait (pure).

Why: issue #21's benchmark sets two goals for managed retention that pull against each
other: new conversations' TTFT within 1.1x of no retention (live work never waits behind
retained KV) and a follow-up hit rate at least stock's. Stock hits every follow-up that comes
within its TTL by never letting go of a turn (new requests wait for its blocks instead). A D
that never makes live work wait can match it only if its cache holds, at every moment, the
requests it serves *and* every retained turn whose conversation will come back. Whether it
does is a fact of the run (the workload, D's size), not of any policy: this module reads it
off the client's records, so a report can say whether a miss was a wrong guess (a D that knew
which turns come back would have kept it) or forced (no D of that size could have).

Counted from a run in which D made no one wait (the ``none`` mode: live work alone), per the
records' token counts, in blocks of ``block_size`` tokens:

* a request holds ``ceil(prompt_tokens / block_size)`` blocks from its first token
  (``sent_at_s + ttft_s``: D admitted it) to its end (``sent_at_s + e2e_s``);
* a turn that the conversation's next turn continues holds the blocks of its KV (its prompt
  and its answer but the last token, whose KV is never computed) from its end until that next
  turn is sent (then P reads it and D frees it); a turn never continued is not counted (a D
  that knew would release it first);
* the ``shared_tokens`` every conversation's prompt starts with are held once (D's prefix
  cache): their full blocks count once while anything is held, not per turn.

Both counts are lower than D's own (a request also grows by its answer; vLLM adds a
watermark), so ``forced_misses`` is a lower bound: at each moment the retained turns exceed
what live work leaves of ``num_blocks``, the fewest of them (largest first) whose blocks cover
the excess must already be gone, and each gone turn is a follow-up lost; the bound is the most
over the run. ``peak_blocks`` is the most held at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from kvrelay.bench.metrics import TurnRecord


@dataclass(frozen=True)
class Hindsight:
    """``peak_blocks``: live requests plus turns still to be continued, at their peak (the
    shared prefix once); ``forced_misses``: follow-ups any D of ``num_blocks`` loses to keep
    live work from waiting, at least; ``continued_turns``: the turns counted as retained."""

    num_blocks: int
    peak_blocks: int
    forced_misses: int
    continued_turns: int


def hindsight(records: Iterable[TurnRecord], *, num_blocks: int, block_size: int,
              shared_tokens: int = 0) -> Hindsight:
    """The ``Hindsight`` of one run's records (module docstring). Failed turns and turns
    without a prompt count are left out; a turn continues the one numbered one below it in
    the same conversation."""
    if num_blocks < 1 or block_size < 1 or shared_tokens < 0:
        raise ValueError("num_blocks and block_size must be >= 1, shared_tokens >= 0")
    shared = shared_tokens // block_size
    ok = sorted((r for r in records if r.succeeded and r.prompt_tokens is not None),
                key=lambda r: (r.conversation_id, r.turn))
    # (time, 1 at a start / 0 at an end, +/-blocks, retained turn key or None): at one
    # time, ends go first
    events: list[tuple[float, int, int, int | None]] = []
    continued = 0
    for record in ok:
        assert record.prompt_tokens is not None and record.ttft_s is not None
        live = max(0, math.ceil(record.prompt_tokens / block_size) - shared)
        start, end = record.sent_at_s + record.ttft_s, record.sent_at_s + record.e2e_s
        events += [(start, 1, live, None), (end, 0, -live, None)]
    for index, (turn, nxt) in enumerate(pairwise(ok)):
        end = turn.sent_at_s + turn.e2e_s
        if nxt.conversation_id != turn.conversation_id or nxt.turn != turn.turn + 1 \
                or nxt.sent_at_s <= end:
            continue
        assert turn.prompt_tokens is not None
        kv_tokens = turn.prompt_tokens + max(0, turn.completion_tokens - 1)
        blocks = max(0, math.ceil(kv_tokens / block_size) - shared)
        continued += 1
        events += [(end, 1, blocks, index), (nxt.sent_at_s, 0, -blocks, index)]
    events.sort(key=lambda e: (e[0], e[1]))
    held = present = 0
    retained: dict[int, int] = {}
    peak = forced = 0
    for _time_s, starts, change, key in events:
        held += change
        present += 1 if starts else -1
        if key is not None and starts:
            retained[key] = change
        elif key is not None:
            del retained[key]
        if present == 0:
            continue
        peak = max(peak, held + shared)
        excess = held + shared - num_blocks
        if excess > 0 and retained:
            forced = max(forced, _fewest_covering(retained.values(), excess))
    return Hindsight(num_blocks=num_blocks, peak_blocks=peak, forced_misses=forced,
                     continued_turns=continued)


def _fewest_covering(sizes: Iterable[int], excess: int) -> int:
    """How many of ``sizes``, largest first, it takes to reach ``excess`` (all of them when
    they do not)."""
    count = 0
    for size in sorted(sizes, reverse=True):
        if excess <= 0:
            break
        excess -= size
        count += 1
    return count


def hindsight_line(seen: Hindsight) -> str:
    """The report's sentence on ``seen`` (the ``none`` mode's records)."""
    head = (f"Hindsight (none's records): live requests plus the {seen.continued_turns} turns "
            f"later continued peak at {seen.peak_blocks} of D's {seen.num_blocks} blocks; ")
    if seen.forced_misses == 0:
        return head + ("a D that knew which turns come back could keep every one without "
                       "making live work wait: a follow-up lost here was lost to not knowing, "
                       "not to D's size.")
    return head + (f"any D of that size that never makes live work wait loses at least "
                   f"{seen.forced_misses} of those follow-ups: D's size costs them, not its "
                   f"guesses (stock keeps them by making new requests wait).")
