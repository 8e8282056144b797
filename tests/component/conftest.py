"""Component-test fixtures: ``redis_server``, a real Redis per test (see ``redis_server.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.component.redis_server import RedisServer, redis_binary


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
