"""router.retain_times: gaps counted per scope and per kind (after a tool call, after a
reply), handed to ``plan_retention`` narrowest first."""

from __future__ import annotations

import json

from kvrelay.router.request import IdRules, TurnRequest, parse_request
from kvrelay.router.retain_times import RetainTimes


def request(tenant: str = "default", conversation_id: str | None = None) -> TurnRequest:
    body: dict[str, object] = {"model": "tiny",
                               "messages": [{"role": "user", "content": "fix the test"}]}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return parse_request("chat", json.dumps(body).encode(), {}, tenant,
                         IdRules((), tenant_is_one_caller=True))


def samples(hists: list[object]) -> list[int | None]:
    return [getattr(h, "samples", None) for h in hists]


def test_each_kind_counts_only_its_own_gaps_at_every_level() -> None:
    times = RetainTimes()
    mine = request(conversation_id="c1")
    for _ in range(3):
        times.observe(mine, 2.0, "tool")
    times.observe(mine, 120.0, "user")
    assert samples(times.histograms(mine, "tool")) == [3, 3, 3]
    assert samples(times.histograms(mine, "user")) == [1, 1, 1]
    tool = times.histograms(mine, "tool")[0]
    assert tool is not None and tool.quantile_s(1.0) < 3.0


def test_scopes_and_tenants_are_kept_apart_and_id_free_requests_have_no_scope() -> None:
    times = RetainTimes()
    times.observe(request("alice", "c1"), 5.0, "tool")
    times.observe(request("bob"), 5.0, "tool")
    assert samples(times.histograms(request("alice", "c1"), "tool")) == [1, 1, 2]
    assert samples(times.histograms(request("alice", "c2"), "tool")) == [None, 1, 2]
    assert samples(times.histograms(request("bob"), "tool")) == [None, 1, 2]
    assert samples(times.histograms(request("carol"), "user")) == [None, None, 0]


def test_the_least_recently_used_conversation_scopes_are_forgotten() -> None:
    times = RetainTimes(max_scopes=2)
    for name in ("a", "b", "c"):
        times.observe(request(conversation_id=name), 1.0, "user")
    assert times.histograms(request(conversation_id="a"), "user")[0] is None
    assert samples(times.histograms(request(conversation_id="c"), "user"))[0] == 1


def test_ends_are_counted_per_kind_so_each_knows_the_share_that_came_back() -> None:
    """Four tool calls ended and all came back; four replies ended and one came back (the
    others abandoned): tool calls' share is 1, replies' a quarter, at every level."""
    times = RetainTimes(decay=1.0)
    mine = request("alice", conversation_id="c1")
    for kind, returns in (("tool", 4), ("user", 1)):
        for i in range(4):
            times.ended(mine.identity, mine.tenant, kind)
            if i < returns:
                times.observe(mine, 3.0, kind)
    for kind, share in (("tool", 1.0), ("user", 0.25)):
        assert [h.return_share() for h in times.histograms(mine, kind) if h is not None] == \
            [share, share, share]
    other = request("bob")
    assert [h.return_share() for h in times.histograms(other, "user") if h is not None] == \
        [0.25]  # only all traffic's: bob's tenant saw nothing
