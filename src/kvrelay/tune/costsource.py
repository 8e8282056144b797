"""The cost model ``kvrelay tune`` predicts with: the router's learned costs, or flags.

The router learns, per P node, the prefill rate and the D -> P transfer overhead and rate
(``core.costs``) and shows them in ``GET /stats`` under ``nodes[].costs``
(``prefill_s_per_token``, ``prefill_samples``, ``transfer_s_per_token``,
``transfer_overhead_s``, ``transfer_samples``). ``costs_from_stats`` averages the P nodes,
each weighted by its samples (a P that has seen nothing counts only if none has). Flags
override single values. The result is a ``core.costs.CostEstimates``, so the predictions use
the router's own formulas (``prefill_s``, ``pull_s``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvrelay.core.costs import (
    DEFAULT_ATTENTION_KNEE_TOKENS,
    DEFAULT_PREFILL_S_PER_TOKEN,
    DEFAULT_TRANSFER_OVERHEAD_S,
    DEFAULT_TRANSFER_S_PER_TOKEN,
    CostEstimates,
    CostLine,
    CostLines,
)


class CostSourceError(ValueError):
    """Stats that cannot be read or hold no P costs."""


@dataclass(frozen=True)
class CostValues:
    """The four numbers of the cost model, and where they came from."""

    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    transfer_overhead_s: float = DEFAULT_TRANSFER_OVERHEAD_S
    transfer_s_per_token: float = DEFAULT_TRANSFER_S_PER_TOKEN
    attention_knee_tokens: int = DEFAULT_ATTENTION_KNEE_TOKENS
    source: str = "defaults (core.costs priors)"

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "transfer_overhead_s", "transfer_s_per_token"):
            if not getattr(self, name) > 0:
                raise CostSourceError(f"{name} must be positive")
        if self.attention_knee_tokens < 1:
            raise CostSourceError("attention_knee_tokens must be >= 1")

    def estimates(self) -> CostEstimates:
        """``CostEstimates`` holding exactly these values (bounds widened to admit them;
        the prefill's fixed per-call cost plays no part in what a pull saves)."""
        return CostEstimates.from_lines(
            CostLines(prefill=CostLine(0.0, self.prefill_s_per_token),
                      pull=CostLine(self.transfer_overhead_s, self.transfer_s_per_token)),
            attention_knee_tokens=self.attention_knee_tokens,
        )

    def with_overrides(self, **values: float | int | None) -> CostValues:
        given = {k: v for k, v in values.items() if v is not None}
        if not given:
            return self
        return replace(self, **given, source=f"{self.source}; flags: "  # type: ignore[arg-type]
                       + ", ".join(f"{k}={v}" for k, v in given.items()))

    def to_json(self) -> dict[str, object]:
        return dict(vars(self))


def costs_from_stats(stats: object, origin: str = "/stats") -> CostValues:
    """Sample-weighted mean of the P nodes' learned costs in a ``/stats`` body."""
    nodes = stats.get("nodes") if isinstance(stats, Mapping) else None
    if not isinstance(nodes, list):
        raise CostSourceError(f"{origin}: no 'nodes' list (is it the router's /stats?)")
    costs = [n["costs"] for n in nodes
             if isinstance(n, Mapping) and isinstance(n.get("costs"), Mapping)]
    if not costs:
        raise CostSourceError(f"{origin}: no P node with learned costs (a tenant's /stats "
                              "has none: save the admin key's, or an open router's)")
    try:
        prefill = _weighted(costs, "prefill_s_per_token", "prefill_samples")
        rate = _weighted(costs, "transfer_s_per_token", "transfer_samples")
        overhead = _weighted(costs, "transfer_overhead_s", "transfer_samples")
    except (TypeError, ValueError) as exc:
        raise CostSourceError(f"{origin}: bad costs: {exc}") from exc
    samples = sum(int(c.get("prefill_samples") or 0) for c in costs)
    return CostValues(prefill, overhead, rate,
                      source=f"router {origin}: {len(costs)} P node(s), {samples} prefill samples")


def load_stats(source: str, timeout_s: float = 10.0) -> Any:
    """A ``/stats`` body from a file or an ``http(s)://`` URL."""
    if source.startswith(("http://", "https://")):
        import httpx

        try:
            resp = httpx.get(source, timeout=timeout_s)
            resp.raise_for_status()
            return resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise CostSourceError(f"{source}: {exc}") from exc
    try:
        return json.loads(Path(source).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CostSourceError(f"{source}: cannot read JSON: {exc}") from exc


def _weighted(costs: Sequence[Mapping[str, Any]], value: str, weight: str) -> float:
    pairs = [(float(c[value]), float(c.get(weight) or 0)) for c in costs]
    total = sum(w for _, w in pairs)
    if total <= 0:
        return sum(v for v, _ in pairs) / len(pairs)
    return sum(v * w for v, w in pairs) / total
