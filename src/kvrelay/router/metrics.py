"""The router's Prometheus metrics, in a registry owned by one app (no module globals).

Names (all prefixed ``kvrelay_router_``):

* ``requests_total{endpoint,status}`` – client requests answered, by route and HTTP status.
* ``turn_decisions_total{action,reason}`` – turn policy decisions.
* ``prompt_tokens_total{source}`` – prompt tokens of routed turns, ``reused`` (pulled or
  reused directly on D) or ``recomputed``.
* ``ttft_seconds{action}`` – router-observed time to the first streamed chunk sent to the client.
* ``turn_seconds{action,stream}`` – router-observed time to the end of the response.
* ``live_entries`` – conversation entries in the store; ``pending_reports`` – turns whose D
  report is awaited.
* ``entry_expirations_total`` – entries found expired at a turn or purged after expiry;
  ``entries_dropped_total{reason}`` – entries removed for other reasons.
* ``node_up{node,role}`` – 1 when the node is routable.
* ``upstream_errors_total{node,kind}`` – failed calls to nodes (see ``upstream``).
* ``retries_total{role}`` – P or D requests retried.
* ``reports_total{outcome}`` – D reports (``matched`` or ``unknown_turn``);
  ``turn_entries_total{outcome}`` – how each D turn settled (``committed``, ``no_kv``,
  ``report_timeout``, ``failed``, ...).
* ``state_errors_total{op}`` – shared-state (Redis) calls that failed or timed out
  (``get``, ``put``, ``claim``, ``drop``, ``drop_node``, ``drop_engine``, ``decode``).
* ``in_flight`` – generation requests in flight (streams until their end);
  ``rejected_requests_total{reason}`` – requests refused before routing: ``overload`` (429,
  over ``max_in_flight``) or ``draining`` (503, shutting down).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_P = "kvrelay_router_"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """All metrics of one router app; ``render()`` gives the exposition text."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            _P + "requests_total", "Client requests by endpoint and status",
            ["endpoint", "status"], registry=r,
        )
        self.decisions = Counter(
            _P + "turn_decisions_total", "Turn decisions by action and reason",
            ["action", "reason"], registry=r,
        )
        self.prompt_tokens = Counter(
            _P + "prompt_tokens_total", "Prompt tokens of routed turns by source",
            ["source"], registry=r,
        )
        self.ttft = Histogram(
            _P + "ttft_seconds", "Router-observed time to first streamed chunk",
            ["action"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.turn_seconds = Histogram(
            _P + "turn_seconds", "Router-observed time to the end of a turn's response",
            ["action", "stream"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.live_entries = Gauge(
            _P + "live_entries", "Conversation entries in the store", registry=r
        )
        self.pending_reports = Gauge(
            _P + "pending_reports", "Turns waiting for their D report", registry=r
        )
        self.expirations = Counter(
            _P + "entry_expirations_total", "Entries that expired", registry=r
        )
        self.dropped = Counter(
            _P + "entries_dropped_total", "Entries removed before use, by reason",
            ["reason"], registry=r,
        )
        self.node_up = Gauge(
            _P + "node_up", "1 if the node is routable", ["node", "role"], registry=r
        )
        self.upstream_errors = Counter(
            _P + "upstream_errors_total", "Failed calls to nodes", ["node", "kind"], registry=r
        )
        self.retries = Counter(
            _P + "retries_total", "Upstream requests retried", ["role"], registry=r
        )
        self.reports = Counter(
            _P + "reports_total", "D reports received, matched to a turn or not",
            ["outcome"], registry=r,
        )
        self.turn_entries = Counter(
            _P + "turn_entries_total", "How D turns settled: committed or why not",
            ["outcome"], registry=r,
        )
        self.in_flight = Gauge(
            _P + "in_flight", "Generation requests in flight", registry=r
        )
        self.rejected = Counter(
            _P + "rejected_requests_total", "Requests refused before routing, by reason",
            ["reason"], registry=r,
        )
        self.state_errors = Counter(
            _P + "state_errors_total", "Shared conversation state calls that failed, by op",
            ["op"], registry=r,
        )

    def track_live_entries(self, count: Callable[[], int]) -> None:
        """Make ``live_entries`` read ``count()`` at scrape time."""
        self.live_entries.set_function(lambda: float(count()))

    def track_pending_reports(self, count: Callable[[], int]) -> None:
        self.pending_reports.set_function(lambda: float(count()))

    def render(self) -> bytes:
        return generate_latest(self.registry)
