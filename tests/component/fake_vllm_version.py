"""Which vLLM protocol the fake engines of the router's component tests speak.

``KVRELAY_FAKE_VLLM_VERSION`` (``0.32``, the default, or ``0.33``; see
``kvrelay.fakevllm.versions``) sets ``FakeEngineConfig.vllm_version`` for every engine a
router test builds through ``engine_config`` (``router_fake.ENGINE_CONFIG`` is one), so one
run of the router tests exercises one protocol. ``make test`` runs them a second time with
``0.33`` (docs/testing.md). Tests of behaviour that differs between versions do not follow
the switch: they name their versions (``test_router_fake_versions.py``).
"""

from __future__ import annotations

import os
from typing import Any

from kvrelay.fakevllm import FakeEngineConfig
from kvrelay.fakevllm.versions import VLLM_VERSIONS, VllmVersion, wire_protocol

ENV = "KVRELAY_FAKE_VLLM_VERSION"


def _from_env() -> VllmVersion:
    raw = os.environ.get(ENV, "0.32").strip()
    try:
        return wire_protocol(raw).version
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(VLLM_VERSIONS)}") from None


FAKE_VLLM_VERSION: VllmVersion = _from_env()


def engine_config(**changes: Any) -> FakeEngineConfig:
    """A ``FakeEngineConfig`` speaking ``FAKE_VLLM_VERSION`` (``changes`` as its fields)."""
    return FakeEngineConfig(**{"vllm_version": FAKE_VLLM_VERSION, **changes})
