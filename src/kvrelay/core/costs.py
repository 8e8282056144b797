"""Throughput estimates the router learns from the requests it has seen.

The turn policy compares two predictions for the reusable prefix of a prompt: the time P
would spend recomputing it, and the time P would spend pulling its KV from D. Both come from
small models fitted online by exponentially weighted moving averages (EWMA):

* prefill: ``seconds = s_per_token * (n + ((c + n)**2 - c**2) / (2 * knee))`` for ``n`` new
  tokens after ``c`` cached ones: a per-token cost that grows linearly with context (attention)
  and doubles at ``attention_knee_tokens``. One learned parameter, so any single observation
  (tokens, context, seconds) updates it without needing a regression.
* transfer: ``seconds = overhead_s + s_per_token * n``. A small pull (``n <=
  overhead_probe_tokens``), whose time is mostly overhead, updates only the overhead (after
  subtracting the current rate's share); a larger pull updates only the per-token rate (after
  subtracting the current overhead). Letting small pulls move the rate too spreads a 40 ms
  overhead over ~150 tokens as 0.25 ms/token: the router then predicted 2k-token pulls at
  several times their cost and recomputed turns that a pull would have served 2x faster (seen
  on the fake engine's ``cpu`` preset: ``cost_model`` on 9 of 9 follow-ups of 0.5-2k tokens).

Estimates start at defaults (priors), move by at most ``alpha`` of the way towards each
sample, each sample is first clamped to ``max_step_ratio`` of the current value and to the
estimate's floor/ceiling: a few noisy samples cannot swing a decision. Everything here is a
frozen value: ``observe`` returns a new estimate and never reads a clock; the router keeps one
per node (or node pair) in its own state.
"""

from __future__ import annotations

import math

import msgspec
from msgspec.structs import replace

DEFAULT_PREFILL_S_PER_TOKEN = 1e-4
DEFAULT_TRANSFER_S_PER_TOKEN = 2e-5
DEFAULT_TRANSFER_OVERHEAD_S = 2e-3
DEFAULT_ATTENTION_KNEE_TOKENS = 32768
DEFAULT_OVERHEAD_PROBE_TOKENS = 256


class BoundedEwma(msgspec.Struct, frozen=True):
    """An EWMA that starts at a prior ``value`` and always stays in ``[floor, ceiling]``."""

    value: float
    floor: float
    ceiling: float
    alpha: float = 0.2
    max_step_ratio: float = 4.0
    num_samples: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.value <= self.ceiling:
            raise ValueError(
                f"need 0 < floor <= value <= ceiling, got {self.floor}, {self.value}, "
                f"{self.ceiling}"
            )
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.max_step_ratio < 1:
            raise ValueError(f"max_step_ratio must be >= 1, got {self.max_step_ratio}")

    def observe(self, sample: float) -> BoundedEwma:
        """The estimate after one more sample; non-finite samples are ignored."""
        if not math.isfinite(sample):
            return self
        low = max(self.floor, self.value / self.max_step_ratio)
        high = min(self.ceiling, self.value * self.max_step_ratio)
        bounded = min(max(sample, low), high)
        value = self.value + self.alpha * (bounded - self.value)
        value = min(max(value, self.floor), self.ceiling)
        return replace(self, value=value, num_samples=self.num_samples + 1)


def _default_prefill_rate() -> BoundedEwma:
    return BoundedEwma(value=DEFAULT_PREFILL_S_PER_TOKEN, floor=1e-7, ceiling=1.0)


def _default_transfer_rate() -> BoundedEwma:
    return BoundedEwma(value=DEFAULT_TRANSFER_S_PER_TOKEN, floor=1e-9, ceiling=0.1)


def _default_transfer_overhead() -> BoundedEwma:
    return BoundedEwma(value=DEFAULT_TRANSFER_OVERHEAD_S, floor=1e-4, ceiling=5.0)


class PrefillEstimate(msgspec.Struct, frozen=True):
    """Prefill cost of one P node (see the module docstring for the model)."""

    seconds_per_token: BoundedEwma = msgspec.field(default_factory=_default_prefill_rate)
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
        return self.seconds_per_token.value * self.work_tokens(num_tokens, context_tokens)

    def observe(self, *, num_tokens: int, context_tokens: int, seconds: float) -> PrefillEstimate:
        """Learn from a prefill that computed ``num_tokens`` after ``context_tokens`` cached
        ones in ``seconds``. Empty or nonsensical samples (no tokens, negative or non-finite
        time) are ignored."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return self
        sample = seconds / self.work_tokens(num_tokens, context_tokens)
        return replace(self, seconds_per_token=self.seconds_per_token.observe(sample))


class TransferEstimate(msgspec.Struct, frozen=True):
    """KV pull cost from one D to one P (see the module docstring for the model)."""

    seconds_per_token: BoundedEwma = msgspec.field(default_factory=_default_transfer_rate)
    overhead_s: BoundedEwma = msgspec.field(default_factory=_default_transfer_overhead)
    overhead_probe_tokens: int = DEFAULT_OVERHEAD_PROBE_TOKENS

    def seconds(self, num_tokens: int) -> float:
        """Predicted pull time; zero when nothing is pulled."""
        if num_tokens <= 0:
            return 0.0
        return self.overhead_s.value + self.seconds_per_token.value * num_tokens

    def observe(self, *, num_tokens: int, seconds: float) -> TransferEstimate:
        """Learn from a pull of ``num_tokens`` that took ``seconds``; nonsensical samples are
        ignored as in ``PrefillEstimate.observe``."""
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return self
        if num_tokens <= self.overhead_probe_tokens:
            overhead = self.overhead_s.observe(
                seconds - self.seconds_per_token.value * num_tokens
            )
            return replace(self, overhead_s=overhead)
        per_token = self.seconds_per_token.observe(
            max(0.0, seconds - self.overhead_s.value) / num_tokens
        )
        return replace(self, seconds_per_token=per_token)


class CostEstimates(msgspec.Struct, frozen=True):
    """The two estimates one turn decision needs: P's prefill and the D -> P pull."""

    prefill: PrefillEstimate = msgspec.field(default_factory=PrefillEstimate)
    transfer: TransferEstimate = msgspec.field(default_factory=TransferEstimate)

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        return self.prefill.seconds(num_tokens, context_tokens)

    def pull_s(self, num_tokens: int) -> float:
        return self.transfer.seconds(num_tokens)
