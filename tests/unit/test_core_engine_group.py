"""Engine ids of a D run data parallel behind one URL: vLLM appends ``_dp<rank>`` to the
configured id (``core.engine_group``)."""

from __future__ import annotations

import pytest

from kvrelay.core.engine_group import dp_rank, engine_group, same_group


@pytest.mark.parametrize(("engine_id", "group", "rank"), [
    ("0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10_dp0", "0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", 0),
    ("decode-engine_dp15", "decode-engine", 15),
    ("0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", "0b1c8e6a-6f1e-4a77-9a55-3f9e2f1d7c10", None),
    ("x_dp", "x_dp", None),            # no rank number
    ("_dp3", "_dp3", None),            # no group before it
    ("a_dp1_dp2", "a_dp1", 2),         # only the last suffix is vLLM's
    ("a_dp1234567", "a_dp1234567", None),  # more digits than any rank
])
def test_group_and_rank(engine_id: str, group: str, rank: int | None) -> None:
    assert engine_group(engine_id) == group
    assert dp_rank(engine_id) == rank


def test_ranks_of_one_start_share_a_group_and_a_restart_does_not() -> None:
    assert same_group("g1_dp0", "g1_dp7")
    assert same_group("g1", "g1")
    assert not same_group("g1_dp0", "g2_dp0")
    assert not same_group("g1", "g2")
