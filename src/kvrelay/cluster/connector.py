"""kvrelay's drop-in ``NixlConnector``: vLLM's pull-mode NIXL connector with CPU fixes.

Loaded by vLLM through ``kv_transfer_config``::

    {"kv_connector": "NixlConnector",
     "kv_connector_module_path": "kvrelay.cluster.connector", ...}

The class keeps the name ``NixlConnector`` because vLLM's config and CPU platform code switch
behaviour on that name (``has_connector("NixlConnector")``). It changes nothing on GPUs.

Fix 1: main-thread affinity (``kvrelay_restore_affinity``, default on)
    On the CPU platform, ``NixlBaseConnectorWorker.__init__`` calls
    ``os.sched_setaffinity(0, [last core of each NUMA node])`` to reserve a core for KV
    transfer. ``0`` is the *calling thread*: the worker's main thread, which runs the forward
    pass, ``start_load_kv`` and the worker's RPC loop, leaves its OpenMP core. With a prefill
    and a decode server on one NUMA node both main threads land on the same last core, next
    to one server's OpenMP threads, and starve: a D->P pull then sits in "KV fetch: 1 in
    progress" for minutes. We restore the main thread's previous affinity right after the
    worker is built. Threads NIXL/UCX start inside the constructor (progress, handshake
    listener) keep the reserved core, which is what vLLM intended.

Fix 2: UCX progress-thread delay (``kvrelay_nixl_progress_delay_us``, default 0 = vLLM's)
    The nixl Python API hard-codes ``pthrDelay = 0``: NIXL's progress thread busy-polls a
    whole core even when idle. On a 2-core host that core is a prefill core. A positive
    value is passed to the agent as its progress-thread delay in microseconds.

Both are proposals for upstream; docs/cpu-notes.md has the measurements.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector
from vllm.logger import init_logger

logger = init_logger(__name__)

RESTORE_AFFINITY_KEY = "kvrelay_restore_affinity"
PROGRESS_DELAY_KEY = "kvrelay_nixl_progress_delay_us"


class NixlConnector(NixlPullConnector):  # type: ignore[misc]
    """vLLM's ``NixlConnector`` (pull mode) plus the CPU fixes in the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer_config = vllm_config.kv_transfer_config
        restore = bool(transfer_config.get_from_extra_config(RESTORE_AFFINITY_KEY, True))
        delay_us = int(transfer_config.get_from_extra_config(PROGRESS_DELAY_KEY, 0))
        is_worker = role == KVConnectorRole.WORKER
        saved = _thread_affinity() if (restore and is_worker) else None
        with _nixl_progress_delay(delay_us if is_worker else 0):
            super().__init__(vllm_config, role, kv_cache_config)
        if saved is not None and _thread_affinity() != saved:
            logger.info(
                "kvrelay: NIXL worker moved the main thread to cores %s; restoring %s",
                sorted(_thread_affinity() or ()),
                sorted(saved),
            )
            os.sched_setaffinity(0, saved)


def _thread_affinity() -> set[int] | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    return set(os.sched_getaffinity(0))


@contextlib.contextmanager
def _nixl_progress_delay(delay_us: int) -> Iterator[None]:
    """Within the block, NIXL agents are created with progress-thread delay ``delay_us``.

    ``nixl_agent.__init__`` builds a ``nixlAgentConfig`` and overwrites ``pthrDelay`` with 0
    before handing it to the ``nixlAgent`` binding; we wrap that binding for the duration of
    the connector's construction, in this process only.
    """
    if delay_us <= 0:
        yield
        return
    import importlib

    api = importlib.import_module("nixl._api")
    bindings = getattr(api, "nixlBind", None)
    real_agent = getattr(bindings, "nixlAgent", None)
    if bindings is None or real_agent is None:
        logger.warning("kvrelay: cannot set NIXL progress delay on this nixl version")
        yield
        return

    def agent_with_delay(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return real_agent(name, config)

    bindings.nixlAgent = agent_with_delay
    try:
        yield
    finally:
        bindings.nixlAgent = real_agent
