"""What a TTL buys and costs, from the retentions of a trace (numpy; docs/tune.md).

For D's ``decoder_kv_blocks_ttl`` ``T``:

* **Hit.** A follow-up *hits* when its gap is at most ``T - router_margin_s``. The margin is
  the router's ``ttl_safety_margin_s + near_expiry_s`` (10 + 15 s by default): the router
  stops pulling that long before D's TTL runs out. Only KV that was retained (more than 0
  tokens) can hit.
* **Pull.** A hit is *pulled* when its usable tokens reach the router's
  ``kv_recompute_threshold`` and the cost model says the pull pays
  (``pull_s * pull_cost_factor <= prefill_s``, ``core.policy``'s rule and ``core.costs``'
  formulas). A pull saves ``prefill_s - pull_s`` of P's time (never counted below 0) and
  reuses its usable tokens.
* **Pinned.** Entries are single-use: a pulled turn's KV is freed when the follow-up
  arrives (``gap`` after the turn ended); anything else (no follow-up, too late, not worth
  pulling) stays pinned for the whole TTL. Pinned KV per D over time is the sum of the
  intervals; peak, time-weighted p95 and mean are taken over the trace's span (first to last
  arrival), in GiB (``kv_bytes_per_token`` each).

Every quantity is a pure function of the retentions and ``ModelParams``; ``RetentionModel``
prepares sorted columns once so each TTL costs one sort of its release times per D.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from kvrelay.core.conversation import DEFAULT_EXPIRY_SAFETY_MARGIN_S
from kvrelay.core.costs import CostEstimates
from kvrelay.core.policy import PolicyConfig
from kvrelay.tune.retention import Retentions

GIB = float(1 << 30)
DEFAULT_ROUTER_MARGIN_S = DEFAULT_EXPIRY_SAFETY_MARGIN_S + PolicyConfig().near_expiry_s
"""The router's ``ttl_safety_margin_s`` (10) + ``near_expiry_s`` (15) defaults."""


@dataclass(frozen=True)
class ModelParams:
    """How the router and the model turn retentions into decisions (module docstring)."""

    kv_bytes_per_token: float
    costs: CostEstimates = field(default_factory=CostEstimates)
    router_margin_s: float = DEFAULT_ROUTER_MARGIN_S
    threshold_tokens: int = 64
    pull_cost_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ValueError("kv_bytes_per_token must be positive")
        if self.router_margin_s < 0 or self.threshold_tokens < 0:
            raise ValueError("router_margin_s and threshold_tokens must be >= 0")
        if self.pull_cost_factor <= 0:
            raise ValueError("pull_cost_factor must be positive")

    def pull_pays(self, num_tokens: int) -> bool:
        """The router's cost rule for a pull of ``num_tokens``."""
        return (self.costs.pull_s(num_tokens) * self.pull_cost_factor
                <= self.costs.prefill_s(num_tokens))

    def saved_s(self, num_tokens: int) -> float:
        """P time a pull of ``num_tokens`` saves over recomputing them (>= 0)."""
        return max(0.0, self.costs.prefill_s(num_tokens) - self.costs.pull_s(num_tokens))


@dataclass(frozen=True)
class DecodeMemory:
    """Pinned KV on one D at one TTL, in GiB."""

    node: str
    peak_gib: float
    p95_gib: float
    mean_gib: float


@dataclass(frozen=True)
class TtlPoint:
    """Everything the model predicts at one TTL (module docstring for the definitions)."""

    ttl_s: float
    followups: int
    hits: int
    pulls: int
    tokens_reused: int
    time_saved_s: float
    pinned_token_s: float
    wasted_token_s: float
    decode: tuple[DecodeMemory, ...]

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.followups if self.followups else None

    @property
    def pull_rate(self) -> float | None:
        return self.pulls / self.followups if self.followups else None

    @property
    def peak_gib(self) -> float:
        """The largest peak over the D's."""
        return max((d.peak_gib for d in self.decode), default=0.0)

    @property
    def p95_gib(self) -> float:
        return max((d.p95_gib for d in self.decode), default=0.0)

    def to_json(self) -> dict[str, object]:
        return {
            "ttl_s": self.ttl_s, "followups": self.followups, "hits": self.hits,
            "pulls": self.pulls, "hit_rate": self.hit_rate, "pull_rate": self.pull_rate,
            "tokens_reused": self.tokens_reused, "time_saved_s": self.time_saved_s,
            "pinned_token_s": self.pinned_token_s, "wasted_token_s": self.wasted_token_s,
            "peak_gib": self.peak_gib, "p95_gib": self.p95_gib,
            "decode": [vars(d) for d in self.decode],
        }


@dataclass(frozen=True)
class PinnedSeries:
    """Pinned KV per D over time at one TTL: ``gib[d][i]`` is the most pinned on D ``d``
    during bin ``i``, which starts ``t_s[i]`` seconds after the trace's first arrival."""

    ttl_s: float
    t_s: tuple[float, ...]
    nodes: tuple[str, ...]
    gib: tuple[tuple[float, ...], ...]


class RetentionModel:
    """The model of the module docstring over one trace's retentions."""

    def __init__(self, retentions: Retentions, params: ModelParams) -> None:
        self.params = params
        self.nodes = retentions.decode_names
        self.first_at_s = retentions.first_at_s
        self.last_at_s = retentions.last_at_s
        self.num_turns = retentions.num_turns
        self.num_conversations = retentions.num_conversations
        self.start = _floats(retentions.start_s)
        self.tokens = _ints(retentions.tokens)
        self.decode = _ints(retentions.decode)
        self.gap = _floats(retentions.gap_s)
        usable = _ints(retentions.usable_tokens)
        followup = np.isfinite(self.gap)
        self.followups = int(followup.sum())
        candidate = followup & (self.tokens > 0)
        self.gaps_sorted = np.sort(self.gap[followup])
        self.hit_gaps = np.sort(self.gap[candidate])
        eligible = candidate & (usable >= max(1, params.threshold_tokens))
        uniq, inverse = np.unique(usable[eligible], return_inverse=True)
        pays = np.array([params.pull_pays(int(n)) for n in uniq], dtype=bool)
        saved = np.array([params.saved_s(int(n)) for n in uniq], dtype=np.float64)
        rows = np.flatnonzero(eligible)[pays[inverse]] if len(uniq) else np.zeros(0, np.int64)
        self.pull_mask_all = np.zeros(len(self.gap), dtype=bool)
        self.pull_mask_all[rows] = True
        order = np.argsort(self.gap[rows], kind="stable")
        self.pull_rows = rows[order]
        self.pull_gaps = self.gap[self.pull_rows]
        self.cum_saved = np.cumsum(saved[inverse][pays[inverse]][order]) if len(
            uniq) else np.zeros(0)
        self.cum_tokens = np.cumsum(usable[self.pull_rows])
        # per D: its rows by start time, their starts and tokens (sorted once, every TTL
        # then only merges in its release times)
        self._rows: list[NDArray[np.int64]] = []
        self._starts: list[NDArray[np.float64]] = []
        self._tokens: list[NDArray[np.float64]] = []
        for d in range(len(self.nodes)):
            mine = np.flatnonzero(self.decode == d)
            mine = mine[np.argsort(self.start[mine], kind="stable")]
            self._rows.append(mine)
            self._starts.append(self.start[mine])
            self._tokens.append(self.tokens[mine].astype(np.float64))

    # -- per TTL -------------------------------------------------------------------------

    def window_s(self, ttl_s: float) -> float:
        """How long after a turn ends its follow-up can still pull at TTL ``ttl_s``."""
        return ttl_s - self.params.router_margin_s

    def at(self, ttl_s: float, pin_s: float | None = None) -> TtlPoint:
        """The prediction at D TTL ``ttl_s``; ``pin_s`` (default ``ttl_s``) is how long D
        keeps KV nobody pulled, if not exactly the TTL the router assumes."""
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        hits = self._count(self.hit_gaps, ttl_s)
        pulls = self._count(self.pull_gaps, ttl_s)
        duration = self._durations(ttl_s if pin_s is None else pin_s, pulls)
        pinned = self.tokens * duration
        pulled = self.pull_rows[:pulls]
        wasted = float(pinned.sum() - pinned[pulled].sum())
        return TtlPoint(
            ttl_s=ttl_s,
            followups=self.followups,
            hits=hits,
            pulls=pulls,
            tokens_reused=int(self.cum_tokens[pulls - 1]) if pulls else 0,
            time_saved_s=float(self.cum_saved[pulls - 1]) if pulls else 0.0,
            pinned_token_s=float(pinned.sum()),
            wasted_token_s=wasted,
            decode=tuple(self._memory(i, duration) for i in range(len(self.nodes))),
        )

    def sweep(self, ttls_s: Sequence[float]) -> list[TtlPoint]:
        return [self.at(t) for t in ttls_s]

    def series(self, ttl_s: float, bins: int = 400) -> PinnedSeries:
        """Pinned KV per D over time at ``ttl_s`` (max per bin), from the first arrival to
        the last release."""
        duration = self._durations(ttl_s, self._count(self.pull_gaps, ttl_s))
        end = float((self.start + duration).max()) if len(self.start) else self.first_at_s
        t0 = self.first_at_s
        width = max(end - t0, 1e-9) / bins
        edges = t0 + width * np.arange(bins + 1)
        out: list[tuple[float, ...]] = []
        for d in range(len(self.nodes)):
            times, levels = self._levels(d, duration)
            per_bin = np.zeros(bins)
            if len(times):
                # the level carried into each bin, then the highest level reached inside it
                idx = np.searchsorted(times, edges[:-1], side="right") - 1
                carried = np.where(idx >= 0, levels[np.maximum(idx, 0)], 0)
                which = np.clip(((times - t0) / width).astype(np.int64), 0, bins - 1)
                inside = np.zeros(bins)
                np.maximum.at(inside, which, levels)
                per_bin = np.maximum(carried, inside)
            out.append(tuple((per_bin * self.params.kv_bytes_per_token / GIB).tolist()))
        return PinnedSeries(ttl_s, tuple((edges[:-1] - t0).tolist()), self.nodes, tuple(out))

    # -- without a grid ------------------------------------------------------------------

    def ceiling(self) -> TtlPoint:
        """What an unlimited TTL would reach: every pull-worthy follow-up pulled (memory is
        not reported: it would be unbounded)."""
        pulls = len(self.pull_rows)
        return TtlPoint(
            ttl_s=math.inf, followups=self.followups, hits=len(self.hit_gaps), pulls=pulls,
            tokens_reused=int(self.cum_tokens[-1]) if pulls else 0,
            time_saved_s=float(self.cum_saved[-1]) if pulls else 0.0,
            pinned_token_s=math.inf, wasted_token_s=math.inf, decode=(),
        )

    def ttl_for_hit_rate(self, target: float) -> float | None:
        """The shortest TTL whose hit rate is at least ``target`` (``None`` if no TTL
        reaches it: too many follow-ups come after turns that retained nothing)."""
        if not 0 < target <= 1:
            raise ValueError("target hit rate must be in (0, 1]")
        need = math.ceil(target * self.followups - 1e-9)
        if need > len(self.hit_gaps) or self.followups == 0:
            return None
        gap = float(self.hit_gaps[need - 1]) if need > 0 else 0.0
        return max(gap + self.params.router_margin_s, 1e-3)

    def gap_percentiles(self, qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
        if not len(self.gaps_sorted):
            return {}
        values = np.percentile(self.gaps_sorted, list(qs))
        return {f"p{q:g}": float(v) for q, v in zip(qs, values, strict=True)}

    def mean_pinned_tokens(self, ttl_s: float, pin_s: float | None = None) -> float:
        """Tokens pinned on all D's together, time-weighted mean over the trace's span, at
        ``ttl_s`` (``pin_s`` as in ``at``)."""
        duration = self._durations(ttl_s if pin_s is None else pin_s,
                                   self._count(self.pull_gaps, ttl_s))
        return self._mean_tokens(duration)

    def mean_entry_tokens(self, expiry_s: float) -> float:
        """The router's view of retention: each turn's entry lives until its conversation's
        next turn (pulled, dropped, or replaced by the next turn's entry) or ``expiry_s``
        after it ended; time-weighted mean over the trace's span, all D's together."""
        return self._mean_tokens(np.minimum(self.gap, expiry_s))

    # -- internals -----------------------------------------------------------------------

    def _count(self, gaps: NDArray[np.float64], ttl_s: float) -> int:
        window = self.window_s(ttl_s)
        return int(np.searchsorted(gaps, window, side="right")) if window >= 0 else 0

    def _mean_tokens(self, duration: NDArray[np.float64]) -> float:
        scale = GIB / self.params.kv_bytes_per_token
        return sum(self._memory(d, duration).mean_gib * scale for d in range(len(self.nodes)))

    def _durations(self, pin_s: float, pulls: int) -> NDArray[np.float64]:
        duration = np.full(len(self.start), float(pin_s))
        rows = self.pull_rows[:pulls]
        duration[rows] = self.gap[rows]
        return duration

    def _levels(
        self, d: int, duration: NDArray[np.float64]
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Event times on D ``d`` (sorted; releases before retentions at equal times) and the
        pinned tokens after each event."""
        start, tokens = self._starts[d], self._tokens[d]
        times = np.concatenate([start + duration[self._rows[d]], start])
        deltas = np.concatenate([-tokens, tokens])
        order = np.argsort(times, kind="stable")  # releases come first in ``times``
        return times[order], np.cumsum(deltas[order])

    def _memory(self, d: int, duration: NDArray[np.float64]) -> DecodeMemory:
        times, levels = self._levels(d, duration)
        scale = self.params.kv_bytes_per_token / GIB
        if not len(times):
            return DecodeMemory(self.nodes[d], 0.0, 0.0, 0.0)
        peak = float(levels.max())
        t0, t1 = self.first_at_s, self.last_at_s
        if t1 <= t0:
            return DecodeMemory(self.nodes[d], peak * scale, peak * scale, peak * scale)
        # levels[i] holds on [times[i], times[i+1]); 0 before the first event and after the last
        lo = np.clip(np.concatenate([[-np.inf], times]), t0, t1)
        hi = np.clip(np.concatenate([times, [np.inf]]), t0, t1)
        seg_level = np.concatenate([[0.0], levels])
        weight = hi - lo
        total = weight.sum()
        if total <= 0:
            return DecodeMemory(self.nodes[d], peak * scale, peak * scale, peak * scale)
        order = np.argsort(seg_level, kind="stable")
        cum = np.cumsum(weight[order])
        at = min(int(np.searchsorted(cum, 0.95 * total)), len(cum) - 1)
        p95 = float(seg_level[order][at])
        mean = float((seg_level * weight).sum() / total)
        return DecodeMemory(self.nodes[d], peak * scale, p95 * scale, mean * scale)


def _ints(values: array[int]) -> NDArray[np.int64]:
    """An int64 view of an ``array("q")`` column (no copy)."""
    return np.frombuffer(values, dtype=np.int64) if len(values) else np.zeros(0, np.int64)


def _floats(values: array[float]) -> NDArray[np.float64]:
    """A float64 view of an ``array("d")`` column (no copy)."""
    return np.frombuffer(values, dtype=np.float64) if len(values) else np.zeros(0)
