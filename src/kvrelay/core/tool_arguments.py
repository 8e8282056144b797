"""Tool-call arguments in the one form both sides of a turn digest them in.

D's answer carries a call's arguments as the model wrote them; the client re-sends them as
it parsed and serialized them again: other spacing, key order, and for a JavaScript client
(Claude Code, Codex) other numbers. ``canonical_arguments`` maps both to the same text, so
the re-sent answer finds the entry D's answer filed (``core.identity.answer_digest``).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_SAFE_INTEGER = 2**53
"""Beyond it an integer is not exact in a JavaScript number (or any IEEE double)."""


def canonical_arguments(arguments: str) -> str:
    """Tool-call arguments as canonical JSON: keys sorted, no spaces, and numbers as the
    *value* a client keeps of them. A JavaScript client (Claude Code, Codex) parses D's
    arguments into doubles and re-sends them: ``1.0`` and ``1e3`` come back as ``1`` and
    ``1000``, an integer past 2**53 rounded to the nearest double. Python keeps ``1.0`` a
    float and big integers exact, so the re-sent answer digested apart from D's and the
    turn recomputed. So integral floats read as integers and integers past 2**53 as the
    double they round to. (A digest only finds the entry; the pull is still proven token
    by token, and cut where a client's rendering differs.)"""
    try:
        return json.dumps(_as_doubles(json.loads(arguments)), sort_keys=True,
                          separators=(",", ":"))
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: as sent
        return arguments


def _as_doubles(value: Any) -> Any:
    """``value`` with every number as the JavaScript number it parses to (see above)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None  # JSON.stringify writes Infinity and NaN as null
        return int(value) if value.is_integer() else value
    if isinstance(value, int):
        if abs(value) <= MAX_SAFE_INTEGER:
            return value
        try:
            return int(float(value))
        except OverflowError:
            return None  # past any double: Infinity in JavaScript, written as null
    if isinstance(value, dict):
        return {k: _as_doubles(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_doubles(v) for v in value]
    return value
