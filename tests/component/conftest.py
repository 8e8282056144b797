"""Component-test fixtures: ``redis_server``, a real Redis per test (see ``redis_server.py``);
the report header names the vLLM protocol the router tests' fake engines speak
(``fake_vllm_version``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.component.fake_vllm_version import ENV, FAKE_VLLM_VERSION
from tests.component.redis_server import RedisServer, redis_binary


def pytest_report_header() -> str:
    return f"fake engines of the router tests speak vLLM {FAKE_VLLM_VERSION} ({ENV})"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
