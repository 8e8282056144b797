"""Benchmark modes: how each one configures the engines and the router.

* ``pull``: bidirectional KV transfer on, P prefix caching off: turn n+1 pulls turn n's KV
  back from D (what kvrelay is for);
* ``recompute``: bidirectional off, otherwise the same engines: the one-way P/D baseline, P
  recomputes the whole history every turn;
* ``local``: P prefix caching on, bidirectional off, one P (the router picks the least-loaded
  P with no conversation affinity, so a single P is what keeps a conversation on the P that
  cached it): the lower bound, reuse at no transfer cost;
* ``direct``: as ``pull`` with the router's ``--direct`` action enabled (short new suffixes go
  straight to the D that holds the history).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvrelay.cluster.config import ClusterConfig


@dataclass(frozen=True)
class ModeSpec:
    """How one mode configures the engines and the router (see the module docstring)."""

    name: str
    bidirectional: bool
    prefill_prefix_caching: bool
    direct: bool = False
    single_prefill: bool = False


MODE_SPECS: tuple[ModeSpec, ...] = (
    ModeSpec("pull", bidirectional=True, prefill_prefix_caching=False),
    ModeSpec("recompute", bidirectional=False, prefill_prefix_caching=False),
    ModeSpec("local", bidirectional=False, prefill_prefix_caching=True, single_prefill=True),
    ModeSpec("direct", bidirectional=True, prefill_prefix_caching=False, direct=True),
)
DEFAULT_MODES = "pull,recompute,local"


def parse_modes(text: str) -> tuple[ModeSpec, ...]:
    """``"pull,recompute"`` -> specs in that order; ``ValueError`` on unknown or repeated."""
    known = {m.name: m for m in MODE_SPECS}
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no mode given")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {sorted(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a mode is repeated in {names}")
    return tuple(known[n] for n in names)


def cluster_config_for(mode: ModeSpec, base: ClusterConfig) -> ClusterConfig:
    """``base`` with the mode's kv-transfer, prefix-caching and P-count settings."""
    return replace(
        base,
        bidirectional=mode.bidirectional,
        prefill_prefix_caching=mode.prefill_prefix_caching,
        num_prefill=1 if mode.single_prefill else base.num_prefill,
    )
