"""How likely a retained turn is still to be pulled, as it ages: the order D releases in.

Under pressure D must give up some retained turns, and a lost pull costs a whole recompute,
so it gives up those least likely to be pulled. That chance falls with the turn's age: a
tool call's result comes back within seconds or (the agent gave up) never, a user thinks
for minutes. ``ReturnCurve`` is what the router learned about how turns that end one way
come back (``core.retention_time``): the share that come back at all (``return_p``) and a
log-normal fit of their gaps (``log_mean``, ``log_sigma``, natural log of seconds). D
evaluates it for each turn at the moment it must choose (``pull_chance``): the chance that
the follow-up arrives before the turn's deadline, given that it has not arrived yet:

    P(pull | age a, deadline T) = p * (S(a) - S(T)) / (1 - p + p * S(a))

where ``S(g)`` is the chance a gap exceeds ``g``. A young turn keeps almost the whole share
``p``; a tool call's turn long past the tools' run time falls towards 0 well before a reply's
of the same age does. Pure; time is passed in.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import msgspec

_STANDARD_NORMAL = NormalDist()


class ReturnCurve(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Of turns that ended one way, the share whose conversation came back (``return_p``)
    and their gaps' log-normal fit (``log_mean``, ``log_sigma`` of ``ln(seconds)``). On the
    wire (``kvrelay_return_curve``): ``[return_p, log_mean, log_sigma]``."""

    return_p: float
    log_mean: float
    log_sigma: float

    def survival(self, gap_s: float) -> float:
        """The chance that a gap is longer than ``gap_s``."""
        if gap_s <= 0:
            return 1.0
        z = math.log(gap_s) - self.log_mean
        if self.log_sigma <= 0:
            return 1.0 if z < 0 else 0.0
        return 1.0 - _STANDARD_NORMAL.cdf(z / self.log_sigma)

    def pull_chance(self, age_s: float, until_s: float) -> float:
        """The chance that the follow-up comes after ``age_s`` and by ``until_s`` (both
        since the turn finished), given that none came by ``age_s``; 0 once ``until_s`` has
        passed."""
        if age_s >= until_s:
            return 0.0
        p = self.return_p
        now, end = self.survival(age_s), self.survival(until_s)
        waiting = (1.0 - p) + p * now
        return 0.0 if waiting <= 0 else min(1.0, p * max(0.0, now - end) / waiting)


def decode_curve(raw: object) -> ReturnCurve | None:
    """A curve from a decode request's params (``[return_p, log_mean, log_sigma]``), or
    ``None`` when absent or not a valid one (D then ranks the turn as stock would: by value
    and age)."""
    if raw is None:
        return None
    try:
        curve = msgspec.convert(raw, ReturnCurve)
    except msgspec.ValidationError:
        return None
    return curve if valid(curve) else None


def valid(curve: ReturnCurve) -> bool:
    """Finite numbers, ``return_p`` a share in [0, 1], ``log_sigma`` >= 0."""
    values = (curve.return_p, curve.log_mean, curve.log_sigma)
    return all(math.isfinite(v) for v in values) and 0.0 <= curve.return_p <= 1.0 \
        and curve.log_sigma >= 0.0
