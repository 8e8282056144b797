"""Test doubles for kvrelay: a protocol-faithful fake vLLM P/D engine (NixlConnector, pull
mode, bidirectional KV transfer; vLLM 0.32's protocol or 0.33's, ``fake_versions``) that runs
many instances in one process. See docs/testing.md.

Start engines with ``FakeCluster`` (``async with``), talk HTTP to ``engine.url``, inject faults
through ``engine.faults`` (or ``POST /fake/faults``), and read what each request reused with
``engine.record(response_id)`` (a ``RequestRecord``). Heavy imports (transformers) happen only
in ``FakeModel.load``.
"""

from kvrelay.testing.fake_cluster import FakeCluster
from kvrelay.testing.fake_config import FakeEngineConfig, RequestRecord
from kvrelay.testing.fake_engine import FakeEngine
from kvrelay.testing.fake_faults import Faults
from kvrelay.testing.fake_kv import FreedRead, Hold, KVFabric
from kvrelay.testing.fake_latency import (
    CPU,
    FAST,
    Clock,
    LatencyModel,
    ManualClock,
    Sleep,
    latency_preset,
)
from kvrelay.testing.fake_model import FakeModel
from kvrelay.testing.fake_report import ReportOutcome

__all__ = [
    "CPU",
    "FAST",
    "Clock",
    "FakeCluster",
    "FakeEngine",
    "FakeEngineConfig",
    "FakeModel",
    "Faults",
    "FreedRead",
    "Hold",
    "KVFabric",
    "LatencyModel",
    "ManualClock",
    "ReportOutcome",
    "RequestRecord",
    "Sleep",
    "latency_preset",
]
