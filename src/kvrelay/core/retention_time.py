"""How long D keeps each turn (``kvrelay_retain_s``), learned from the gaps between turns.

vLLM keeps every finished turn for one global TTL (480 s by default), whether its
conversation comes back in 2 s or never. The gaps between a conversation's turns (a user's
think time, an agent's tool call) are heavy-tailed, and many conversations never come back,
so most of that retention pins blocks nobody reads. ``decide_retain_s`` picks a turn's
retention from what the router has seen:

* **The rule is ``kvrelay tune``'s** (``tune.model``, the offline form of this decision):
  a follow-up after a gap ``g`` can pull only when ``g <= retain_s - router_margin_s``,
  where ``router_margin_s`` is the router's ``ttl_safety_margin_s + near_expiry_s``. So
  catching a share ``q`` of the follow-ups that come back takes
  ``retain_s = quantile_q(gaps) + router_margin_s``.
* **Learned online, per scope.** ``GapHistogram`` counts observed gaps in log-spaced bins
  (bounded memory, heavy tails kept; older samples decay so a changed workload is followed).
  ``decide_retain_s`` uses the narrowest of the histograms it is given (say a conversation
  id's, then its tenant's, then all traffic's) that holds ``min_samples`` gaps; with none,
  the prior: D's TTL (what stock vLLM does).
* **The tail.** The quantile that decides is high (0.997: a lost follow-up costs a whole
  recompute, a longer retention only blocks that D releases on demand). A few hundred gaps
  cannot show it (their 0.997 quantile is their maximum, short on a heavy tail), so the time
  is the larger of the histogram's quantile and a log-normal fit's
  (``GapHistogram.fit_quantile_s``): heavy tails are extrapolated, and gaps bounded by a
  timeout (a tool's), where the fit runs long, are kept to the fit's time, never cut short.
* **Per kind of gap.** What follows a turn depends on how it ended (``GapKind``): after a
  tool call the client runs the tool and comes back within the tool's run time (seconds,
  bounded by the harness's tool timeout), after a reply the user thinks for minutes, or
  never comes back. The two are learned apart and ``plan_retention`` decides both before D
  answers (``RetainPlan``): D is told the longer, as it cannot tell how its answer ends; the
  router, once it has read the answer, keeps the entry ``after(kind)`` and releases D's
  blocks when that is shorter (``RetainPlan.shortened``). A kind without enough gaps of its
  own keeps the prior; a kind never seen (tool calls in a chat deployment without tools)
  does not lengthen what D is told.
* **D's headroom.** When D's last sync shows less than ``low_free_fraction`` of its KV cache
  available to live work (``available_fraction``: free blocks and retained ones, which D
  releases on demand under pressure), the time shrinks in proportion (to ``min_scale`` of it
  at worst): retention yields before live work has to wait. Retained blocks count as
  available so that retention does not shorten itself because of its own blocks.
* **Return curve.** Beside the retention, how turns like this one come back
  (``core.return_curve.ReturnCurve``): the share of turns that ended this way whose
  conversation came back (``GapHistogram.return_share``: returns over ends, both counted by
  the router) and the log-normal fit of their gaps. Under pressure or headroom D releases the
  turns least likely still to be pulled first (``core.retention.release_order``); the prior
  has no curve (D ranks by age, as stock would).
* **Bounds.** Never above D's TTL (D clamps too: ``core.retention_sync.clamp_retain_s``),
  never below ``router_margin_s + min_window_s`` (a shorter one could never be pulled).

Pure: gaps and D's free share are passed in; values are frozen (``observe`` returns a new
histogram).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

import msgspec

from kvrelay.core.conversation import DEFAULT_EXPIRY_SAFETY_MARGIN_S, GapKind
from kvrelay.core.policy import PolicyConfig
from kvrelay.core.return_curve import ReturnCurve

GAP_MIN_S = 0.25
GAP_MAX_S = 7200.0
NUM_BINS = 48
_LOG_MIN = math.log(GAP_MIN_S)
_LOG_SPAN = math.log(GAP_MAX_S) - _LOG_MIN
_STANDARD_NORMAL = NormalDist()

RetainReason = Literal["prior", "learned", "headroom"]
"""Where a retention time came from: D's TTL (too few gaps seen), the gaps' quantile, or
the quantile shortened because D is short of free blocks."""


def bin_upper_s(index: int) -> float:
    """The largest gap bin ``index`` holds (bins are log-spaced over [GAP_MIN_S,
    GAP_MAX_S]; the first also holds shorter gaps, the last longer ones)."""
    return math.exp(_LOG_MIN + _LOG_SPAN * (index + 1) / NUM_BINS)


def bin_of(gap_s: float) -> int:
    if gap_s <= GAP_MIN_S:
        return 0
    at = (math.log(gap_s) - _LOG_MIN) / _LOG_SPAN * NUM_BINS
    return min(NUM_BINS - 1, max(0, math.ceil(at) - 1))


LOG_FLOOR_S = 1e-3
"""Gaps shorter than this count as this in the log-normal fit (a follow-up sent at once)."""


class GapHistogram(msgspec.Struct, frozen=True):
    """Observed gaps between turns, weighted (each sample 1, times ``decay`` per later
    sample: an effective window of ``1 / (1 - decay)`` samples), in log-spaced bins and as
    the weighted sums of their logarithms and squared logarithms (``fit_quantile_s``).
    Beside them, turns that ended (``end``) and of those the ones that came back (each
    ``observe``), weighted per end (``return_share``)."""

    counts: tuple[float, ...] = (0.0,) * NUM_BINS
    total: float = 0.0
    samples: int = 0
    log_sum: float = 0.0
    log_sq_sum: float = 0.0
    ended: float = 0.0
    returned: float = 0.0

    def observe(self, gap_s: float, *, decay: float = 0.998) -> GapHistogram:
        """The histogram after one more gap (a negative or non-finite one is ignored)."""
        if not math.isfinite(gap_s) or gap_s < 0:
            return self
        hit = bin_of(gap_s)
        counts = tuple(c * decay + (1.0 if i == hit else 0.0)
                       for i, c in enumerate(self.counts))
        log_gap = math.log(max(gap_s, LOG_FLOOR_S))
        return GapHistogram(counts, self.total * decay + 1.0, self.samples + 1,
                            self.log_sum * decay + log_gap,
                            self.log_sq_sum * decay + log_gap * log_gap,
                            self.ended, self.returned + 1.0)

    def end(self, *, decay: float = 0.998) -> GapHistogram:
        """The histogram after one more turn ended this way (its follow-up, if any, is
        an ``observe`` later)."""
        return msgspec.structs.replace(self, ended=self.ended * decay + 1.0,
                                       returned=self.returned * decay)

    def return_share(self) -> float:
        """The share of turns that ended this way whose conversation came back, in [0, 1];
        1 before any end was counted (unknown: every turn may come back)."""
        if self.ended <= 0:
            return 1.0
        return min(1.0, self.returned / self.ended)

    def log_fit(self) -> tuple[float, float]:
        """The weighted mean and standard deviation of ``log(gap)`` (0, 0 when empty)."""
        if self.total <= 0:
            return 0.0, 0.0
        mean = self.log_sum / self.total
        return mean, math.sqrt(max(0.0, self.log_sq_sum / self.total - mean * mean))

    def curve(self) -> ReturnCurve:
        """How turns that ended this way come back: ``return_share`` and ``log_fit``."""
        mean, sigma = self.log_fit()
        return ReturnCurve(self.return_share(), mean, sigma)

    def fit_quantile_s(self, q: float) -> float:
        """The ``q`` quantile of the log-normal distribution with the gaps' weighted mean and
        variance of ``log(gap)``. A heavy tail's high quantile, which a few hundred gaps
        cannot show (a 0.999 quantile of 100 gaps is only their maximum), comes from the
        fit; for gaps bounded by a timeout (a tool's) the fit errs long, never short."""
        if not 0.0 < q < 1.0:
            raise ValueError(f"q is a share in (0, 1), got {q}")
        if self.total <= 0:
            return GAP_MAX_S
        mean, sigma = self.log_fit()
        return min(GAP_MAX_S, math.exp(mean + _STANDARD_NORMAL.inv_cdf(q) * sigma))

    def quantile_s(self, q: float) -> float:
        """The smallest bin edge at or below which a share ``q`` of the weight lies (an
        upper bound of the true quantile: retention errs long)."""
        if not 0.0 < q <= 1.0:
            raise ValueError(f"q is a share in (0, 1], got {q}")
        if self.total <= 0:
            return GAP_MAX_S
        need = q * self.total
        seen = 0.0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= need - 1e-9:
                return bin_upper_s(i)
        return bin_upper_s(NUM_BINS - 1)


@dataclass(frozen=True)
class RetentionTimeConfig:
    """Operator knobs (module docstring). ``router_margin_s`` must be the router's
    ``ttl_safety_margin_s + near_expiry_s`` (the defaults: ``tune.model``'s
    ``DEFAULT_ROUTER_MARGIN_S``)."""

    quantile: float = 0.997
    fit_tail: bool = True
    min_samples: int = 32
    router_margin_s: float = DEFAULT_EXPIRY_SAFETY_MARGIN_S + PolicyConfig().near_expiry_s
    min_window_s: float = 5.0
    low_free_fraction: float = 0.2
    min_scale: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 < self.quantile <= 1.0:
            raise ValueError("quantile must be in (0, 1]")
        if self.min_samples < 1:
            raise ValueError("min_samples must be >= 1")
        if self.router_margin_s < 0 or self.min_window_s <= 0:
            raise ValueError("router_margin_s must be >= 0 and min_window_s > 0")
        if not 0.0 <= self.low_free_fraction < 1.0 or not 0.0 < self.min_scale <= 1.0:
            raise ValueError("low_free_fraction in [0, 1), min_scale in (0, 1]")

    @property
    def samples_needed(self) -> int:
        """Gaps a histogram needs before its quantile is used: ``min_samples``; without the
        tail's fit (``fit_tail``) at least ``1 / (1 - quantile)`` too (a high quantile of
        fewer gaps is only their maximum, which errs short on a heavy tail)."""
        if self.fit_tail or self.quantile >= 1.0:
            return self.min_samples
        return max(self.min_samples, math.ceil(1.0 / (1.0 - self.quantile) - 1e-9))

    @property
    def floor_s(self) -> float:
        """The shortest retention that can still be pulled at all."""
        return self.router_margin_s + self.min_window_s


def available_fraction(*, num_blocks_free: int, retained_blocks: int,
                       num_blocks_total: int) -> float:
    """The share of D's KV cache live work can have: free blocks plus retained ones (D
    releases retention on demand), in [0, 1]; 0 for an empty cache."""
    if num_blocks_total <= 0:
        return 0.0
    return min(1.0, max(0, num_blocks_free + retained_blocks) / num_blocks_total)


class RetainTime(msgspec.Struct, frozen=True):
    """How long D keeps one turn, and why; ``gap_quantile_s`` is the learned quantile used
    (``None`` for the prior); ``curve`` how such turns come back (``kvrelay_return_curve``;
    ``None`` for the prior)."""

    retain_s: float
    reason: RetainReason
    gap_quantile_s: float | None = None
    curve: ReturnCurve | None = None


def decide_retain_s(
    histograms: Sequence[GapHistogram | None],
    *,
    ttl_s: float,
    free_fraction: float | None,
    config: RetentionTimeConfig,
) -> RetainTime:
    """A turn's retention time on a D whose TTL is ``ttl_s`` (module docstring).
    ``histograms`` go narrowest first; ``free_fraction`` is the share of D's KV cache
    available to live work at its last sync (``available_fraction``; ``None``: unknown)."""
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    floor_s = min(config.floor_s, ttl_s)
    need = config.samples_needed
    chosen = next((h for h in histograms if h is not None and h.samples >= need), None)
    reason: RetainReason = "prior"
    retain_s, quantile_s, curve = ttl_s, None, None
    if chosen is not None:
        quantile_s = chosen.quantile_s(config.quantile)
        if config.fit_tail and config.quantile < 1.0:
            quantile_s = max(quantile_s, chosen.fit_quantile_s(config.quantile))
        curve = chosen.curve()
        retain_s, reason = quantile_s + config.router_margin_s, "learned"
    low = config.low_free_fraction
    if free_fraction is not None and low > 0 and free_fraction < low:
        scale = max(config.min_scale, max(0.0, free_fraction) / low)
        retain_s, reason = retain_s * scale, "headroom"
    retain_s = min(ttl_s, max(floor_s, retain_s))
    return RetainTime(retain_s, reason, quantile_s, curve)


class RetainPlan(msgspec.Struct, frozen=True):
    """A turn's retention for each way it can end (module docstring): ``user`` after a
    reply, ``tool`` after a tool call; ``on_d`` what D is told (``kvrelay_retain_s``,
    ``kvrelay_return_curve``): the longer of the kinds seen, since D cannot tell how its
    answer ends."""

    user: RetainTime
    tool: RetainTime
    on_d: RetainTime

    def after(self, kind: GapKind) -> RetainTime:
        """The retention once the answer is known to end this way."""
        return self.tool if kind == "tool" else self.user

    def shortened(self, kind: GapKind) -> bool:
        """Whether the entry keeps less than D was told (the router then releases D's
        blocks at the entry's expiry)."""
        return self.after(kind).retain_s < self.on_d.retain_s


def plan_retention(
    tool: Sequence[GapHistogram | None],
    user: Sequence[GapHistogram | None],
    *,
    ttl_s: float,
    free_fraction: float | None,
    config: RetentionTimeConfig,
) -> RetainPlan:
    """``decide_retain_s`` for each kind from its own histograms (narrowest first). A kind
    with too few gaps keeps the prior (D's TTL: retention errs long while it learns). A kind
    never seen (no gap in any of its histograms: a chat deployment without tools never sees
    a tool call's) does not lengthen what D is told; a turn that ends that way after all
    keeps D's time."""
    kinds = {
        "user": decide_retain_s(user, ttl_s=ttl_s, free_fraction=free_fraction, config=config),
        "tool": decide_retain_s(tool, ttl_s=ttl_s, free_fraction=free_fraction, config=config),
    }
    seen = [kinds[k] for k, hs in (("user", user), ("tool", tool))
            if any(h is not None and h.samples > 0 for h in hs)]
    on_d = max(seen, key=lambda t: t.retain_s) if seen else kinds["user"]
    return RetainPlan(user=kinds["user"], tool=kinds["tool"], on_d=on_d)
