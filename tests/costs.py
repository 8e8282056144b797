"""Fixed costs for every test router: no verdict may depend on how fast the machine is.

A router learns its cost lines from wall-clock timings of P's calls (``core.costs``), and
the cost model decides pull vs recompute from them: on a loaded machine a rig's recomputes
can look cheap and its pulls dear, and a test that expects a pull then sees ``cost_model``
(docs/testing.md, "Costs are injected"). Every rig therefore starts its router with fixed
costs (``RouterConfig.costs``, ``learn_costs=False``; ``kvrelay route --fixed-costs``):

* ``PULL_PAYS`` – the default: a pull costs 1 ms + 1 us/token, a recompute 1 ms/token, so
  any pull above the threshold pays;
* ``RECOMPUTE_PAYS`` – the opposite, for the tests of the cost model: a pull costs 1 s + 1
  ms/token, a recompute 1 us/token.

Tests of the learning itself use the rig's ``learn_costs=True`` and inject the timings.
"""

from __future__ import annotations

from typing import Any

from kvrelay.core.costs import CostLine, CostLines

PULL_PAYS = CostLines(prefill=CostLine(0.0, 1e-3), pull=CostLine(1e-3, 1e-6))
RECOMPUTE_PAYS = CostLines(prefill=CostLine(0.0, 1e-6), pull=CostLine(1.0, 1e-3))


def fixed(lines: CostLines = PULL_PAYS) -> dict[str, Any]:
    """Router settings for ``lines``, never learned."""
    return {"costs": lines, "learn_costs": False}


def fixed_costs_flag(lines: CostLines = PULL_PAYS) -> str:
    """``lines`` as ``kvrelay route --fixed-costs``' value."""
    return (f"prefill_fixed_s={lines.prefill.fixed_s!r},"
            f"prefill_s_per_token={lines.prefill.s_per_token!r},"
            f"pull_fixed_s={lines.pull.fixed_s!r},pull_s_per_token={lines.pull.s_per_token!r}")
