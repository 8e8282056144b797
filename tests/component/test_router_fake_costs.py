"""The cost model through the router, with fake vLLM engines: injected costs decide a turn
both ways, fixed costs are never learned, and learned costs follow the timings the engines
simulate on the shared ``ManualClock`` (so the verdicts never depend on this machine)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.core.costs import CostLines
from kvrelay.fakevllm import ManualClock
from kvrelay.fakevllm.latency import LatencyModel
from tests.component.router_fake import ENGINE_CONFIG, GUARD_CONFIGS, Routed, routed
from tests.component.router_rig import Chat
from tests.costs import PULL_PAYS, RECOMPUTE_PAYS, fixed

HISTORY = "Summarise the build log and list every failing test with its error. " * 48
"""~820 tokens (~17 per repetition with the BPE tokenizer)."""
STEP_REPEATS = 60
"""A turn's new text: ``f"Step {i}: the tool printed "`` ~8 tokens, so ~480 tokens a turn."""


class ClockSleep:
    """The engines' simulated latency, spent on the shared ``ManualClock`` instead of the
    wall clock: a P call then takes exactly its simulated seconds on the router's clock, the
    timings the router learns from are injected, not measured."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock

    async def __call__(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await asyncio.sleep(0)


async def decisions(r: Routed, turns: int, *, conversation: str = "c") -> list[dict[str, Any]]:
    """Run one conversation of ``turns`` turns; the router's decision for each."""
    chat = Chat(r, conversation, model="tiny", max_tokens=8)
    out: list[dict[str, Any]] = []
    for i in range(turns):
        step = f"Step {i}: the tool printed " * STEP_REPEATS
        resp, _ = await chat.turn(HISTORY if i == 0 else step)
        assert resp.status_code == 200, resp.text
        await r.settle()
        out.append(dict(await r.last_decision()))
    return out


@pytest.mark.parametrize("guard", list(GUARD_CONFIGS))
@pytest.mark.parametrize(("lines", "reason"), [(PULL_PAYS, "pull"),
                                                (RECOMPUTE_PAYS, "cost_model")])
async def test_injected_costs_decide_the_turn_both_ways(
    lines: CostLines, reason: str, guard: str
) -> None:
    """The same conversation pulls under costs where a pull is cheaper, and recomputes
    (``cost_model``) under costs where recomputing is: the costs alone decide."""
    async with routed(engine_config=GUARD_CONFIGS[guard], **fixed(lines)) as r:
        seen = await decisions(r, 3)
        assert [d["reason"] for d in seen] == ["no_entry", reason, reason]
        p = r.cluster.prefill[0]
        pulled = [rec.pulled_tokens for rec in p.records]
        if reason == "pull":
            assert all(n > 0 for n in pulled[1:]) and seen[-1]["reused_tokens"] > 0
        else:
            assert pulled == [0, 0, 0] and seen[-1]["reused_tokens"] == 0


async def test_fixed_costs_are_never_learned() -> None:
    async with routed(**fixed(RECOMPUTE_PAYS)) as r:
        await decisions(r, 3)
        (costs,) = [n["costs"] for n in (await r.stats())["nodes"] if n["costs"] is not None]
        assert costs["prefill_samples"] == 0 and costs["transfer_samples"] == 0
        assert costs["transfer_overhead_s"] == RECOMPUTE_PAYS.pull.fixed_s
        assert costs["prefill_s_per_token"] == RECOMPUTE_PAYS.prefill.s_per_token


CHEAP_RECOMPUTE = LatencyModel(request_overhead_s=0.1, prefill_s_per_token=2e-5,
                               transfer_overhead_s=0.3, transfer_s_per_token=1e-4)
"""The tiny model's case: P prefills fast, a pull pays a large fixed cost."""
CHEAP_PULL = LatencyModel(request_overhead_s=0.02, prefill_s_per_token=6e-4,
                          transfer_overhead_s=0.02, transfer_s_per_token=1e-6)
"""The bench model's case: P's prefill is dear, a pull nearly free."""


@pytest.mark.parametrize(("latency", "settled"), [(CHEAP_RECOMPUTE, "cost_model"),
                                                   (CHEAP_PULL, "pull")])
async def test_learned_costs_follow_the_engines_timings(
    latency: LatencyModel, settled: str
) -> None:
    """From the priors (which favour pulls), a router that learns from P's timings (here
    simulated on the shared clock) settles on what is cheaper within a few samples: on
    engines where recomputing is cheaper it stops pulling after at most three pulls, and
    where pulling is cheaper it keeps pulling."""
    clock = ManualClock()
    config = replace(ENGINE_CONFIG, latency=latency)
    async with routed(engine_config=config, clock=clock, sleep=ClockSleep(clock),
                      learn_costs=True, costs=None) as r:
        first = await decisions(r, 2, conversation="warm")  # one sample of each kind
        assert [d["reason"] for d in first] == ["no_entry", "pull"]
        later = [d["reason"] for d in await decisions(r, 6)][1:]
        if settled == "pull":
            assert later == ["pull"] * 5
        else:
            assert later.count("pull") <= 2 and later[-3:] == ["cost_model"] * 3
