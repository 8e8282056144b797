"""Test doubles for kvrelay: a protocol-faithful fake vLLM P/D engine (NixlConnector, pull
mode, bidirectional KV transfer; vLLM 0.32's protocol or 0.33's, ``versions``) that runs
many instances in one process. See docs/testing.md.

Start engines with ``FakeCluster`` (``async with``), talk HTTP to ``engine.url``, inject faults
through ``engine.faults`` (or ``POST /fake/faults``), and read what each request reused with
``engine.record(response_id)`` (a ``RequestRecord``). Heavy imports (transformers) happen only
in ``FakeModel.load``.
"""

from kvrelay.fakevllm.cluster import FakeCluster
from kvrelay.fakevllm.config import FakeEngineConfig, RequestRecord
from kvrelay.fakevllm.engine import FakeEngine
from kvrelay.fakevllm.faults import Faults
from kvrelay.fakevllm.kv import FreedRead, Hold, KVFabric
from kvrelay.fakevllm.latency import (
    CPU,
    FAST,
    Clock,
    LatencyModel,
    ManualClock,
    Sleep,
    latency_preset,
)
from kvrelay.fakevllm.model import FakeModel
from kvrelay.fakevllm.report import ReportOutcome

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
