"""The least retained block-seconds ANY retention policy needs to catch stock's hits.

``kvrelay bench retention`` asks managed retention for two things at once (issue #21): a
follow-up hit rate at least stock's, and at most half stock's retained block-seconds. A hit
needs its turn's blocks on D from the moment the turn ended until its follow-up arrives (the
think time ``gap``), so even an oracle that knows which conversations come back and when,
and retains exactly those turns for exactly their gaps, holds ``blocks x gap`` per hit.
Catching ``N`` hits costs at least the sum of the ``N`` smallest ``blocks x gap`` products of
the workload's follow-ups (``oracle``). A policy that cannot see the future, and so decides by
a turn's age alone (as learned retention does: nothing tells a turn whose conversation is
abandoned from one that comes back later), must keep *every* turn for a window ``w`` at
least the ``N``-th smallest gap; a turn that is followed up is read (and freed) at its gap,
one that is not is held the whole ``w`` (``window``). This script builds the bench's workload
(the same generator and defaults as ``kvrelay bench retention``) and prints both bounds:

* against a measured run (``--results DIR``: a ``bench retention --out DIR``; stock's hits
  and block-seconds are read from its ``retention.json``);
* per seed (``--seeds``), against a model of stock without pressure (every turn held until
  its follow-up reads it or for the whole TTL, as the bench scales it: 480 s -> 15 s + the
  reader's unscaled 5 s margin, 640 workload seconds at time scale 32; hits: follow-ups
  before the router's entry expires). The model
  ignores stock's stalls, which make its measured block-seconds larger than the model's.

Workload seconds throughout (the bench's time scale undone). The bound is not a policy: it
knows the future; it says when the two goals cannot both hold on a workload.

    .venv/bin/python scripts/retention_window_bound.py --results results/bench-retention-X
    .venv/bin/python scripts/retention_window_bound.py --seeds 0-11
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench.tokens import default_counter
from kvrelay.bench.trace_replay import ScaledSettings
from kvrelay.bench.workloads import Pacing, ThinkTime, Workload, agent_workload

BLOCK_TOKENS = 128
"""D's block size in the bench's fake engines (``--decode-kv-blocks`` counts these)."""


@dataclass(frozen=True)
class FollowUp:
    conversation_id: str
    turn: int
    gap_s: float
    """Workload seconds from the previous turn's end to this turn's arrival."""
    blocks: int
    """Blocks of the previous turn D retains (its prompt and answer)."""

    @property
    def block_seconds(self) -> float:
        return self.blocks * self.gap_s


@dataclass(frozen=True)
class Retained:
    """One turn D retains: its blocks, and the gap to its follow-up (``None``: none)."""

    blocks: int
    gap_s: float | None


def retained_turns(workload: Workload, answer_tokens: int, time_scale: float) -> list[Retained]:
    out: list[Retained] = []
    for conv in workload.conversations:
        for k, spec in enumerate(conv.turns):
            blocks = math.ceil((spec.target_tokens + answer_tokens - 1) / BLOCK_TOKENS)
            nxt = conv.turns[k + 1] if k + 1 < len(conv.turns) else None
            out.append(Retained(blocks, nxt.think_s * time_scale if nxt else None))
    return out


def least_block_seconds(gaps: list[Retained], hits: int) -> float:
    """The sum of the ``hits`` smallest ``blocks x gap`` among follow-ups (inf when there
    are fewer follow-ups)."""
    costs = sorted(r.blocks * r.gap_s for r in gaps if r.gap_s is not None)
    return sum(costs[:hits]) if hits <= len(costs) else math.inf


def least_window_block_seconds(turns: list[Retained], hits: int) -> tuple[float, float]:
    """``(w, block-seconds)`` of the shortest window common to all turns that catches
    ``hits`` follow-ups: each turn held ``min(gap, w)`` (``w`` without a follow-up)."""
    gaps = sorted(r.gap_s for r in turns if r.gap_s is not None)
    if hits > len(gaps):
        return math.inf, math.inf
    w = gaps[hits - 1] if hits > 0 else 0.0
    return w, sum(r.blocks * min(w, r.gap_s if r.gap_s is not None else w) for r in turns)


def stock_model(turns: list[Retained], pin_s: float, expiry_s: float) -> tuple[int, float]:
    """Stock without pressure: (hits, block-seconds) when every turn is held until its
    follow-up reads it or for D's TTL (``pin_s``: the bench's scaled TTL plus the reader's
    unscaled margin, in workload seconds); hits: follow-ups before the router's entry
    expires (``expiry_s``)."""
    hits = sum(1 for r in turns if r.gap_s is not None and r.gap_s <= expiry_s)
    held = sum(r.blocks * min(pin_s, r.gap_s if r.gap_s is not None else pin_s)
               for r in turns)
    return hits, held


def build(args: argparse.Namespace, seed: int) -> Workload:
    scale = args.time_scale
    pacing = Pacing(ThinkTime(args.think, args.think_mean_s / scale, args.think_sigma,
                              args.think_max_s / scale), args.arrival_mean_s / scale)
    return agent_workload(
        default_counter(args.model), conversations=args.conversations, turns=args.max_turns,
        system_tokens=args.system_tokens, user_tokens=args.user_tokens,
        answer_tokens=args.answer_tokens, pacing=pacing, abandon_p=args.abandon_p, seed=seed,
        salt="bound")


def seeds_of(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=None,
                   help="a `kvrelay bench retention --out` folder (its seed and stock figures)")
    p.add_argument("--seeds", default="0", help="e.g. 0-11 or 0,3,5 (model of stock)")
    p.add_argument("--goal", type=float, default=0.5, help="block-seconds goal, x stock's")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--abandon-p", type=float, default=0.3)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=96)
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--think", default="lognormal")
    p.add_argument("--think-mean-s", type=float, default=60.0)
    p.add_argument("--think-sigma", type=float, default=1.5)
    p.add_argument("--think-max-s", type=float, default=600.0)
    p.add_argument("--arrival-mean-s", type=float, default=32.0)
    p.add_argument("--time-scale", type=float, default=32.0)
    p.add_argument("--ttl-s", type=float, default=480.0)
    p.add_argument("--model", default="tiny")
    args = p.parse_args(argv)

    if args.results is not None:
        data = json.loads((args.results / "retention.json").read_text())
        stock = data["modes"]["stock"]
        seed = int(data["params"]["seed"])
        turns = retained_turns(build(args, seed), args.answer_tokens, args.time_scale)
        hits, measured = int(stock["pulled"]), float(stock["block_seconds"])
        bound = least_block_seconds(turns, hits)
        w, windowed = least_window_block_seconds(turns, hits)
        print(f"seed {seed}: stock caught {hits} follow-ups with {measured:,.0f} block-s; "
              f"catching {hits}: oracle >= {bound:,.0f} block-s = {bound / measured:.3f}x "
              f"stock's; by age alone (window {w:.0f} s) >= {windowed:,.0f} block-s = "
              f"{windowed / measured:.3f}x (goal <= {args.goal:g}x)")
    print("| seed | follow-ups | stock hits (model) | stock block-s (model) | oracle | "
          "window w | by age alone | by age alone / stock | both goals by age alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    impossible = 0
    seeds = seeds_of(args.seeds)
    for seed in seeds:
        turns = retained_turns(build(args, seed), args.answer_tokens, args.time_scale)
        settings = ScaledSettings.for_ttl(args.ttl_s, args.time_scale)
        hits, held = stock_model(turns, settings.d_pin_s, settings.router_expiry_s)
        bound = least_block_seconds(turns, hits)
        w, windowed = least_window_block_seconds(turns, hits)
        ratio = windowed / held if held > 0 else math.nan
        ok = ratio <= args.goal
        impossible += 0 if ok else 1
        followups = sum(1 for r in turns if r.gap_s is not None)
        print(f"| {seed} | {followups} | {hits} | {held:,.0f} | {bound / held:.3f}x | "
              f"{w:.0f} s | {windowed:,.0f} | {ratio:.3f}x | {'yes' if ok else '**no**'} |")
    print(f"\nby age alone, both goals impossible on {impossible} of {len(seeds)} seeds "
          "(model of stock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
