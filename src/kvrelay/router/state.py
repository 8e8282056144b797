"""The per-app bundle of router state, built by ``create_app`` (never a module global)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.router.auth import Authenticator
from kvrelay.router.commit import ReportDesk
from kvrelay.router.config import RouterConfig
from kvrelay.router.engine_check import EngineChecks
from kvrelay.router.index import ConversationIndex
from kvrelay.router.limits import Admission
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.nodes import NodeRegistry
from kvrelay.router.response_store import ResponseStore
from kvrelay.router.retention import RetentionDesk
from kvrelay.router.stats import RouterStats
from kvrelay.router.stock_release import StockReleases
from kvrelay.router.turnlog import TurnLogWriter
from kvrelay.router.upstream import Upstream


@dataclass
class RouterContext:
    """Everything one router app owns. ``clock`` is the router clock (entry expiry, policy
    ``now_s``); durations for metrics and cost estimates use ``time.perf_counter``."""

    config: RouterConfig
    clock: Callable[[], float]
    upstream: Upstream
    nodes: NodeRegistry
    index: ConversationIndex
    desk: ReportDesk
    metrics: RouterMetrics
    stats: RouterStats
    admission: Admission
    auth: Authenticator
    retention: RetentionDesk
    tag_key: bytes
    stock_releases: StockReleases
    turn_log: TurnLogWriter | None = None
    responses: ResponseStore | None = None
    """The Responses store (``--response-store``; ``None``: off)."""
    engine_checks: EngineChecks | None = None
    """Checks of a D's engine that reports or syncs naming another raise (set by the app)."""
