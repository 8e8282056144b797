"""Workload generators: token targets within one KV block, determinism from the seed, salts,
and think-time distributions."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.bench.tokens import byte_template_counter, chat_template_counter
from kvrelay.bench.workloads import (
    BLOCK_TOKENS,
    TOOL_CALL_TOKENS,
    Pacing,
    ThinkTime,
    WorkloadError,
    agent_workload,
    appending,
    fill_text,
    placeholder_answer,
    planned_history,
    sweep_workload,
)
from kvrelay.models import ensure_model

count = byte_template_counter


def assert_targets_hit(workload, counter):
    for conv in workload.conversations:
        for i, turn in enumerate(conv.turns):
            got = counter(planned_history(conv, i, counter))
            assert turn.target_tokens - BLOCK_TOKENS < got <= turn.target_tokens, (
                conv.conversation_id, i, got, turn.target_tokens)


def test_sweep_follow_ups_hit_each_context_length_within_a_block():
    w = sweep_workload(count, conversations_per_length=2, salt="s")
    assert w.kind == "sweep" and w.concurrency == 1
    assert [c.context_tokens for c in w.conversations] == [
        L for L in (2048, 4096, 8192, 16384, 24576) for _ in range(2)]
    assert_targets_hit(w, count)
    for conv in w.conversations:
        first, follow = conv.turns
        assert follow.target_tokens == conv.context_tokens
        assert follow.measured and not first.measured
        assert [m["role"] for m in first.new_messages] == ["system", "user"]
        assert [m["role"] for m in follow.new_messages] == ["user"]
        assert first.max_tokens == 32 and follow.max_tokens == 16
        assert follow.think_s == 1.0


def test_sweep_targets_hold_with_the_real_tokenizer():
    real = chat_template_counter(ensure_model("tiny"))
    w = sweep_workload(real, lengths=(2048, 16384), conversations_per_length=1)
    assert_targets_hit(w, real)


def test_agent_turns_hit_their_targets_without_drift():
    w = agent_workload(count, conversations=3, turns=20, system_tokens=700, user_tokens=150,
                       answer_tokens=300, salt="s")
    assert_targets_hit(w, count)
    conv = w.conversations[0]
    assert [t.target_tokens for t in conv.turns[:3]] == [850, 1300, 1750]
    assert conv.turns[-1].target_tokens == 700 + 20 * 150 + 19 * 300
    assert all(t.max_tokens == 300 for t in conv.turns)
    assert [m["role"] for m in conv.turns[0].new_messages] == ["system", "user"]
    assert all([m["role"] for m in t.new_messages] == ["user"] for t in conv.turns[1:])
    assert conv.turns[1].new_messages[0]["content"].startswith("Tool result:\n")


def test_agent_targets_hold_with_the_real_tokenizer():
    real = chat_template_counter(ensure_model("tiny"))
    assert_targets_hit(agent_workload(real, conversations=2, turns=6), real)


def test_workloads_are_deterministic_from_seed_and_salt():
    assert agent_workload(count, conversations=4, seed=7, salt="a") == agent_workload(
        count, conversations=4, seed=7, salt="a")
    assert sweep_workload(count, lengths=(2048,), seed=7) == sweep_workload(
        count, lengths=(2048,), seed=7)
    a = agent_workload(count, conversations=4, seed=7, salt="a")
    b = agent_workload(count, conversations=4, seed=8, salt="a")
    assert a.conversations[0].turns[0].new_messages != b.conversations[0].turns[0].new_messages
    assert [t.think_s for t in a.conversations[0].turns] != [
        t.think_s for t in b.conversations[0].turns]


def test_salt_and_index_differ_within_the_first_kv_block():
    def first_block(w, i):
        return w.conversations[i].turns[0].new_messages[0]["content"][:BLOCK_TOKENS - 20]

    a = agent_workload(count, conversations=2, salt="run1")
    b = agent_workload(count, conversations=2, salt="run2")
    assert first_block(a, 0) != first_block(b, 0)
    assert first_block(a, 0) != first_block(a, 1)
    s = sweep_workload(count, lengths=(2048,), conversations_per_length=2, salt="x")
    assert first_block(s, 0) != first_block(s, 1)


def test_a_shared_system_prompt_is_the_same_in_every_conversation_of_a_run_only():
    def system(w, i):
        return w.conversations[i].turns[0].new_messages[0]["content"]

    a = agent_workload(count, conversations=3, system_tokens=700, shared_system_tokens=400,
                       salt="run1")
    b = agent_workload(count, conversations=1, system_tokens=700, shared_system_tokens=400,
                       salt="run2")
    shared = system(a, 0).split("\n")[0]
    assert len(shared) > 300 and all(system(a, i).startswith(shared + "\n") for i in (1, 2))
    assert system(a, 0) != system(a, 1), "each conversation's own part follows"
    assert not system(b, 0).startswith(shared), "another salt shares nothing"
    assert a.params["shared_system_tokens"] == 400
    assert_targets_hit(a, count)
    assert "shared_system_tokens" not in agent_workload(count, conversations=1).params
    with pytest.raises(WorkloadError):
        agent_workload(count, conversations=1, system_tokens=300, shared_system_tokens=400)


def test_conversation_ids_are_unique():
    for w in (sweep_workload(count, conversations_per_length=3),
              agent_workload(count, conversations=12)):
        ids = [c.conversation_id for c in w.conversations]
        assert len(set(ids)) == len(ids)


def test_agent_arrivals_and_concurrency():
    w = agent_workload(count, conversations=50, pacing=Pacing(arrival_mean_s=2.0))
    starts = [c.start_s for c in w.conversations]
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == 50
    assert 1.4 < statistics.mean(b - a for a, b in itertools.pairwise(starts)) < 2.6
    assert w.concurrency == 50
    together = agent_workload(count, conversations=5,
                              pacing=Pacing(arrival_mean_s=0, concurrency=2))
    assert {c.start_s for c in together.conversations} == {0.0}
    assert together.concurrency == 2


def test_first_turn_never_thinks_and_later_turns_follow_the_distribution():
    w = agent_workload(count, conversations=2, turns=5,
                       pacing=Pacing(ThinkTime("constant", 3.5)))
    for conv in w.conversations:
        assert [t.think_s for t in conv.turns] == [0.0, 3.5, 3.5, 3.5, 3.5]


def test_targets_below_the_fixed_overhead_are_rejected():
    with pytest.raises(WorkloadError, match="below the fixed overhead"):
        sweep_workload(count, lengths=(100,))
    with pytest.raises(WorkloadError):
        agent_workload(count, conversations=0)
    with pytest.raises(WorkloadError):
        sweep_workload(count, lengths=())


@settings(max_examples=60, deadline=None)
@given(target=st.integers(min_value=40, max_value=5000), seed=st.integers(0, 1000))
def test_fill_text_is_as_long_as_fits(target, seed):
    build = appending([{"role": "system", "content": "s"}], "user", "head: ")
    text = fill_text(build, count, target, random.Random(seed))
    assert count(build(text)) <= target
    # the next word (at most 8 bytes, plus a space) would not fit
    assert count(build(text)) > target - 9


def test_placeholder_answer_has_the_planned_length():
    base = count([{"role": "assistant", "content": ""}])
    for n in (1, 16, 300):
        text = placeholder_answer(n, count)
        assert n - 8 < count([{"role": "assistant", "content": text}]) - base <= n


class TestThinkTime:
    N = 20000

    def samples(self, think, seed=1):
        rng = random.Random(seed)
        return [think.sample(rng) for _ in range(self.N)]

    def test_exponential_mean_and_tail(self):
        xs = self.samples(ThinkTime("exponential", 10.0))
        assert min(xs) >= 0
        assert statistics.mean(xs) == pytest.approx(10.0, rel=0.05)
        # P(X > 3 * mean) = e^-3: the tail that outlives a TTL of three means
        beyond = sum(1 for x in xs if x > 30.0) / self.N
        assert beyond == pytest.approx(math.exp(-3), rel=0.15)

    def test_lognormal_mean_and_median(self):
        think = ThinkTime("lognormal", 10.0, sigma=1.0)
        xs = self.samples(think)
        assert min(xs) > 0
        assert statistics.mean(xs) == pytest.approx(10.0, rel=0.07)
        assert statistics.median(xs) == pytest.approx(10.0 * math.exp(-0.5), rel=0.05)

    def test_uniform_and_constant(self):
        xs = self.samples(ThinkTime("uniform", 4.0))
        assert min(xs) >= 0 and max(xs) <= 8.0
        assert statistics.mean(xs) == pytest.approx(4.0, rel=0.03)
        assert set(self.samples(ThinkTime("constant", 2.5))) == {2.5}
        assert set(self.samples(ThinkTime("exponential", 0.0))) == {0.0}

    def test_invalid(self):
        with pytest.raises(WorkloadError):
            ThinkTime("exponential", -1.0)
        with pytest.raises(WorkloadError):
            ThinkTime("gamma", 1.0)  # type: ignore[arg-type]


def test_abandoned_conversations_keep_a_prefix_of_their_turns():
    full = agent_workload(count, conversations=200, turns=6, system_tokens=300,
                          user_tokens=40, answer_tokens=20, seed=3)
    cut = agent_workload(count, conversations=200, turns=6, system_tokens=300,
                         user_tokens=40, answer_tokens=20, seed=3, abandon_p=0.3)
    lengths = [len(c.turns) for c in cut.conversations]
    for a, b in zip(full.conversations, cut.conversations, strict=True):
        assert a.turns[: len(b.turns)] == b.turns and a.start_s == b.start_s
    # P(a conversation has k turns) = 0.7**(k-1) * 0.3 below the cap: all lengths occur,
    # and about 30% stop after their first turn (binomial, 200 draws: far from 10% or 50%)
    assert set(lengths) == {1, 2, 3, 4, 5, 6}
    assert 20 < lengths.count(1) < 100
    assert cut.params["abandon_p"] == 0.3
    with pytest.raises(WorkloadError):
        agent_workload(count, conversations=1, abandon_p=1.0)


def workload_digest(w):
    """A digest of everything a workload's conversations send, when and how long."""
    import hashlib
    import json

    data = [[c.conversation_id, c.start_s, c.context_tokens,
             [[[dict(m) for m in t.new_messages], t.max_tokens, t.think_s, t.target_tokens,
               t.measured] for t in c.turns]] for c in w.conversations]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def test_without_tool_calls_the_agent_workload_is_the_one_built_before_tools():
    # the digest of this very workload as agent_workload built it before it modelled tool
    # calls (same messages, think times, starts and abandonment)
    before_tools = "1228850aa0198fb10ab2ed27ba7eed57f577774eea792d4f4a60f74399b1d030"
    args = dict(conversations=6, turns=7, system_tokens=300, user_tokens=40, answer_tokens=20,
                pacing=Pacing(ThinkTime("lognormal", 2.0, 1.5, 9.0), 3.0), abandon_p=0.3,
                seed=5, salt="g")
    w = agent_workload(count, **args)
    assert workload_digest(w) == before_tools and w.num_turns == 19
    assert not any(t.tool_call for c in w.conversations for t in c.turns)
    assert w.params["tool_p"] == 0.0
    # the tool-time distribution changes nothing without tool calls
    assert workload_digest(agent_workload(count, tool_time=ThinkTime("constant", 99.0),
                                          **args)) == before_tools


TOOLS = dict(conversations=40, turns=8, system_tokens=300, user_tokens=40, answer_tokens=20,
             pacing=Pacing(ThinkTime("constant", 50.0), 1.0), tool_p=0.7,
             tool_time=ThinkTime("lognormal", 2.0, 1.5, 6.0), seed=2, salt="t")


def test_tool_call_turns_are_followed_by_tool_results_after_tool_times():
    w = agent_workload(count, **TOOLS)
    assert w == agent_workload(count, **TOOLS)  # deterministic
    assert w != agent_workload(count, **{**TOOLS, "seed": 3})
    turns = [t for c in w.conversations for t in c.turns]
    calls = sum(t.tool_call for t in turns)
    assert 0.55 < calls / len(turns) < 0.85  # binomial, 320 draws of p = 0.7
    tool_gaps = []
    for conv in w.conversations:
        assert conv.turns[0].think_s == 0.0
        for prev, turn in itertools.pairwise(conv.turns):
            assert prev.max_tokens == 20 + (TOOL_CALL_TOKENS if prev.tool_call else 0)
            (message,) = turn.new_messages
            if prev.tool_call:  # the harness comes back with the tool's result
                assert message["role"] == "tool"
                assert message["content"].startswith("Tool result:\n")
                tool_gaps.append(turn.think_s)
            else:  # the user comes back with a task after a think time
                assert message["role"] == "user" and message["content"].startswith("Task: ")
                assert turn.think_s == 50.0
    # drawn from the tool time (lognormal, median 2 * exp(-1.5**2 / 2) = 0.65 s), cut at 6
    below = [g for g in tool_gaps if g < 6.0]
    assert len(tool_gaps) > 100 and max(tool_gaps) == 6.0
    assert len(set(below)) == len(below) and 0.4 < statistics.median(tool_gaps) < 1.0
    # planned sizes: the module contract, tool calls planned as max_tokens of answer
    assert_targets_hit(w, count)
    assert w.params["tool_p"] == 0.7
    assert (w.params["tool_time"], w.params["tool_mean_s"], w.params["tool_sigma"],
            w.params["tool_max_s"]) == ("lognormal", 2.0, 1.5, 6.0)
    assert w.params["tool_call_tokens"] == TOOL_CALL_TOKENS
    with pytest.raises(WorkloadError):
        agent_workload(count, conversations=1, tool_p=1.5)


def test_tool_call_targets_hold_with_the_real_tokenizer():
    real = chat_template_counter(ensure_model("tiny"))
    w = agent_workload(real, conversations=2, turns=6, tool_p=0.6, seed=4)
    assert any(t.tool_call for c in w.conversations for t in c.turns)
    assert_targets_hit(w, real)


def test_tool_calls_draw_from_their_own_streams():
    base = agent_workload(count, **{**TOOLS, "tool_p": 0.3})
    more = agent_workload(count, **TOOLS)
    for a, b in zip(base.conversations, more.conversations, strict=True):
        # a turn that calls a tool at p = 0.3 calls one at p = 0.7 too (one uniform draw each)
        assert all(tb.tool_call for ta, tb in zip(a.turns, b.turns, strict=True)
                   if ta.tool_call)
        assert a.start_s == b.start_s


def test_abandonment_follows_every_turn_whatever_the_tool_calls():
    full = agent_workload(count, **TOOLS)
    cut = agent_workload(count, **{**TOOLS, "abandon_p": 0.5})
    for a, b in zip(full.conversations, cut.conversations, strict=True):
        assert a.turns[: len(b.turns)] == b.turns
    ends = [c.turns[-1].tool_call for c in cut.conversations if len(c.turns) < 8]
    assert True in ends and False in ends  # cut after tool calls and after replies
    assert sum(len(c.turns) for c in cut.conversations) < full.num_turns
    # the draws do not depend on tool_p: the same conversations are cut as without tools
    calls = agent_workload(count, **{**TOOLS, "tool_p": 1.0, "abandon_p": 0.5})
    plain = agent_workload(count, **{**TOOLS, "tool_p": 0.0, "abandon_p": 0.5})
    assert [len(c.turns) for c in calls.conversations] == [
        len(c.turns) for c in plain.conversations] == [len(c.turns) for c in cut.conversations]


def test_a_tool_turns_budget_holds_the_fake_engines_whole_call():
    from kvrelay.bench.messages_client import TOOL_NAME
    from kvrelay.fakevllm.messages_api import ToolCall
    from kvrelay.fakevllm.model import FakeModel

    model = FakeModel.load()
    call = ToolCall(TOOL_NAME)
    for answer_tokens in (1, 48):
        generated = [model.answer_ids[0]] * (answer_tokens + TOOL_CALL_TOKENS)
        text = model.decode(call.output(model, generated))
        block = call.tool_use("id", text)
        assert block is not None and set(block["input"]) == {"input"}, text
