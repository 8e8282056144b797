"""The Prometheus text format (``GET /metrics`` of vLLM, the router, the fake engine) as
numbers a test or a script can compare."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def parse_prometheus(text: str) -> dict[str, float]:
    """Every sample, keyed ``name{labels}`` exactly as exposed; comments and lines that do
    not parse are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                continue
    return out


def external_kv_tokens(metrics: Mapping[str, float]) -> float:
    """Prompt tokens a vLLM server took from another node's KV (NIXL), summed over labels."""
    return sum(
        v for k, v in metrics.items()
        if k.startswith("vllm:prompt_tokens_by_source_total") and "external_kv_transfer" in k
    )
