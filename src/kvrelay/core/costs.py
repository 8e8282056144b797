"""Cost estimates the turn policy compares: what P spends recomputing, what a pull costs.

Each cost is a line, ``seconds = fixed_s + s_per_token * x`` (``CostLine``):

* prefill, per P: ``x`` is the work of ``n`` new tokens after ``c`` cached ones, in
  context-free tokens, ``n + ((c + n)**2 - c**2) / (2 * knee)`` (a per-token cost that grows
  linearly with context, attention, and doubles at ``attention_knee_tokens``); ``fixed_s`` is
  what every P call costs whatever its length (HTTP, scheduling, the one sampled token);
* pull, per P (from any D): ``x`` is the number of tokens pulled; ``fixed_s`` is what every
  pull costs (the NIXL handshake/notification round trips, the connector's checks).

What a pull of ``n`` tokens saves is the prefill's *marginal* cost of them (``prefill_s``:
``s_per_token * work(n)``; P is called either way, so its ``fixed_s`` is paid either way);
what it costs is the whole pull line (``pull_s``). A sample is always a whole P call: for a
recompute, its time fits the prefill line; for a pull, the time left after the predicted
prefill call of the suffix (``prefill_call_s``) fits the pull line (``core.consequences``).

Why lines, fitted from the samples (``LineFit``): the estimates before this were rates,
moved 20% of the way towards each sample, each sample first clamped to 4x the estimate, and
the pull's fixed cost was learned only from pulls of at most 256 tokens. A fresh router on
the tiny model (1.5k-token turns, P's prefill about as fast as a pull) therefore kept the
priors' verdict: a prior pull rate 5x cheaper than the prefill rate needed 4+ pull samples
just to reach parity, the prefill rate learned only from first turns, and the demo pulled
on every turn although recomputing was as fast. A ``LineFit`` is an exponentially weighted
least-squares fit of a line to its samples, regularised by its prior as two pseudo-samples of
total weight ``prior_weight`` (one sample's worth): after two or three samples the data
decide, while one cold outlier (a first NIXL handshake, a first compile) is still clamped
to ``max_step_ratio`` of the current prediction and its weight decays by ``decay`` per later
sample. The fitted ``fixed_s`` is never negative and ``s_per_token`` stays within its floor
and ceiling, so any sequence of samples leaves a usable line.

Everything here is a frozen value: ``observe`` returns a new estimate and never reads a
clock; the router keeps one ``CostEstimates`` per P node in its own state, and can be given
fixed ones (``RouterConfig.costs``/``learn_costs``; ``CostEstimates.from_lines``).
"""

from __future__ import annotations

import math

import msgspec
from msgspec.structs import replace

DEFAULT_PREFILL_S_PER_TOKEN = 1e-4
DEFAULT_PREFILL_FIXED_S = 0.0
DEFAULT_TRANSFER_S_PER_TOKEN = 2e-5
DEFAULT_TRANSFER_OVERHEAD_S = 2e-3
DEFAULT_ATTENTION_KNEE_TOKENS = 32768
DEFAULT_PRIOR_TOKENS = 1024.0
"""Where a prior's second pseudo-sample sits (its first is at zero tokens)."""


class CostLine(msgspec.Struct, frozen=True):
    """``seconds = fixed_s + s_per_token * x``; both non-negative, ``s_per_token`` positive."""

    fixed_s: float
    s_per_token: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ValueError(f"fixed_s must be finite and >= 0, got {self.fixed_s}")
        if not (math.isfinite(self.s_per_token) and self.s_per_token > 0):
            raise ValueError(f"s_per_token must be finite and > 0, got {self.s_per_token}")

    def seconds(self, x: float) -> float:
        return self.fixed_s + self.s_per_token * x


class CostLines(msgspec.Struct, frozen=True):
    """The two lines a decision compares: P's prefill (``x``: work tokens) and the pull
    (``x``: tokens pulled). ``RouterConfig.costs`` is one: the fixed costs a router starts
    from (and keeps, with ``learn_costs=False``)."""

    prefill: CostLine = msgspec.field(
        default_factory=lambda: CostLine(DEFAULT_PREFILL_FIXED_S, DEFAULT_PREFILL_S_PER_TOKEN))
    pull: CostLine = msgspec.field(
        default_factory=lambda: CostLine(DEFAULT_TRANSFER_OVERHEAD_S,
                                         DEFAULT_TRANSFER_S_PER_TOKEN))


class LineFit(msgspec.Struct, frozen=True):
    """A ``CostLine`` fitted online to ``(x, seconds)`` samples (module docstring).

    ``sum_*`` are the decayed weighted sums of the samples (weight 1 when observed, times
    ``decay`` per later sample). The prior's pseudo-samples, at ``x = 0`` and
    ``x = prior_tokens`` on the ``prior`` line, weigh ``prior_weight`` together and decay
    like a sample, down to ``min_prior_weight``: enough to keep the fit defined when every
    sample has the same ``x`` (then the line goes through the samples with the prior's
    split between fixed and per-token parts), too little to bias a fit the samples define.
    ``line`` is the current fit. Build one with ``LineFit.starting_at``.
    """

    prior: CostLine
    line: CostLine
    prior_tokens: float = DEFAULT_PRIOR_TOKENS
    prior_weight: float = 1.0
    min_prior_weight: float = 0.02
    decay: float = 0.9
    max_step_ratio: float = 4.0
    max_fixed_s: float = 5.0
    min_s_per_token: float = 1e-9
    max_s_per_token: float = 1.0
    sum_w: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0 < self.min_prior_weight <= self.prior_weight or self.prior_tokens <= 0:
            raise ValueError("need 0 < min_prior_weight <= prior_weight, prior_tokens > 0")
        if self.max_step_ratio < 1:
            raise ValueError(f"max_step_ratio must be >= 1, got {self.max_step_ratio}")
        if not 0 < self.min_s_per_token <= self.max_s_per_token:
            raise ValueError("need 0 < min_s_per_token <= max_s_per_token")

    @classmethod
    def starting_at(cls, prior: CostLine, **settings: float) -> LineFit:
        """A fit with no samples yet, predicting ``prior``."""
        return cls(prior=prior, line=prior, **settings)  # type: ignore[arg-type]

    def seconds(self, x: float) -> float:
        return self.line.seconds(x)

    def observe(self, x: float, seconds: float) -> LineFit:
        """The fit after one more sample; samples with ``x <= 0`` or a negative or
        non-finite time are ignored."""
        if not (math.isfinite(x) and x > 0 and math.isfinite(seconds) and seconds >= 0):
            return self
        predicted = self.line.seconds(x)
        y = min(max(seconds, predicted / self.max_step_ratio), predicted * self.max_step_ratio)
        d = self.decay
        fit = replace(
            self,
            sum_w=self.sum_w * d + 1.0,
            sum_x=self.sum_x * d + x,
            sum_y=self.sum_y * d + y,
            sum_xx=self.sum_xx * d + x * x,
            sum_xy=self.sum_xy * d + x * y,
            num_samples=self.num_samples + 1,
        )
        return replace(fit, line=fit._solve())

    def _solve(self) -> CostLine:
        """Weighted least squares over the samples and the prior's two pseudo-samples."""
        half = max(self.prior_weight * self.decay**self.num_samples, self.min_prior_weight) / 2
        x0 = self.prior_tokens
        y_at_0 = self.prior.fixed_s
        y_at_x0 = self.prior.seconds(x0)
        w = self.sum_w + 2 * half
        sx = self.sum_x + half * x0
        sy = self.sum_y + half * (y_at_0 + y_at_x0)
        sxx = self.sum_xx + half * x0 * x0
        sxy = self.sum_xy + half * x0 * y_at_x0
        det = w * sxx - sx * sx  # > 0: the pseudo-samples sit at two distinct x
        slope = (w * sxy - sx * sy) / det
        fixed = (sy - slope * sx) / w
        if fixed < 0:  # the best line through the origin instead
            fixed, slope = 0.0, sxy / sxx
        slope = min(max(slope, self.min_s_per_token), self.max_s_per_token)
        fixed = min(max(fixed, 0.0), self.max_fixed_s)
        return CostLine(fixed, slope)


def _default_prefill_fit() -> LineFit:
    return LineFit.starting_at(CostLines().prefill, min_s_per_token=1e-7)


def _default_transfer_fit() -> LineFit:
    return LineFit.starting_at(CostLines().pull)


class PrefillEstimate(msgspec.Struct, frozen=True):
    """Prefill cost of one P node (see the module docstring for the model)."""

    fit: LineFit = msgspec.field(default_factory=_default_prefill_fit)
    attention_knee_tokens: int = DEFAULT_ATTENTION_KNEE_TOKENS

    def __post_init__(self) -> None:
        if self.attention_knee_tokens < 1:
            raise ValueError("attention_knee_tokens must be >= 1")

    def work_tokens(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Cost of ``num_tokens`` new tokens after ``context_tokens``, in context-free tokens."""
        if num_tokens <= 0:
            return 0.0
        start = max(0, context_tokens)
        end = start + num_tokens
        return num_tokens + (end * end - start * start) / (2 * self.attention_knee_tokens)

    def seconds(self, num_tokens: int, context_tokens: int = 0) -> float:
        """The marginal time of ``num_tokens`` more (no fixed per-call cost): what a pull of
        them saves."""
        return self.fit.line.s_per_token * self.work_tokens(num_tokens, context_tokens)

    def call_seconds(self, num_tokens: int, context_tokens: int = 0) -> float:
        """The predicted time of a whole P call that computes ``num_tokens``."""
        return self.fit.line.fixed_s + self.seconds(num_tokens, context_tokens)

    def observe(self, *, num_tokens: int, context_tokens: int, seconds: float) -> PrefillEstimate:
        """Learn from a P call that computed ``num_tokens`` after ``context_tokens`` cached
        ones in ``seconds``. Empty or nonsensical samples (no tokens, negative or non-finite
        time) are ignored."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return self
        work = self.work_tokens(num_tokens, context_tokens)
        return replace(self, fit=self.fit.observe(work, seconds))


class TransferEstimate(msgspec.Struct, frozen=True):
    """KV pull cost from one D to one P (see the module docstring for the model)."""

    fit: LineFit = msgspec.field(default_factory=_default_transfer_fit)

    def seconds(self, num_tokens: int) -> float:
        """Predicted pull time; zero when nothing is pulled."""
        if num_tokens <= 0:
            return 0.0
        return self.fit.seconds(num_tokens)

    def observe(self, *, num_tokens: int, seconds: float) -> TransferEstimate:
        """Learn from a pull of ``num_tokens`` that took ``seconds``; nonsensical samples are
        ignored as in ``PrefillEstimate.observe``."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return self
        return replace(self, fit=self.fit.observe(float(num_tokens), seconds))


class CostEstimates(msgspec.Struct, frozen=True):
    """The two estimates one turn decision needs: P's prefill and the D -> P pull."""

    prefill: PrefillEstimate = msgspec.field(default_factory=PrefillEstimate)
    transfer: TransferEstimate = msgspec.field(default_factory=TransferEstimate)

    @classmethod
    def from_lines(
        cls, lines: CostLines, attention_knee_tokens: int = DEFAULT_ATTENTION_KNEE_TOKENS
    ) -> CostEstimates:
        """Estimates that predict exactly ``lines`` (until they observe a sample); the
        bounds are widened to admit them."""
        def fit(line: CostLine) -> LineFit:
            return LineFit.starting_at(
                line, min_s_per_token=min(1e-9, line.s_per_token),
                max_s_per_token=max(1.0, line.s_per_token),
                max_fixed_s=max(5.0, line.fixed_s))
        return cls(PrefillEstimate(fit(lines.prefill), attention_knee_tokens),
                   TransferEstimate(fit(lines.pull)))

    @property
    def lines(self) -> CostLines:
        """The current prefill and pull lines."""
        return CostLines(self.prefill.fit.line, self.transfer.fit.line)

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        """What recomputing ``num_tokens`` (after ``context_tokens``) adds to a P call."""
        return self.prefill.seconds(num_tokens, context_tokens)

    def pull_s(self, num_tokens: int) -> float:
        return self.transfer.seconds(num_tokens)
