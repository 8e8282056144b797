"""The router's Prometheus metrics, in a registry owned by one app (no module globals).

Names (all prefixed ``kvrelay_router_``):

* ``requests_total{endpoint,status}`` – client requests answered, by route and HTTP status
  (``GET`` / ``DELETE /v1/responses/{id}`` as the one endpoint ``/v1/responses/{id}``).
* ``turn_decisions_total{action,reason}`` – turn policy decisions.
* ``prompt_tokens_total{source}`` – prompt tokens of routed turns, ``reused`` (pulled or
  reused directly on D) or ``recomputed``.
* ``ttft_seconds{action}`` – router-observed time to the first streamed chunk sent to the client.
* ``turn_seconds{action,stream}`` – router-observed time to the end of the response.
* ``live_entries`` – conversation entries in the store; ``pending_reports`` – turns whose D
  report is awaited.
* ``entry_expirations_total`` – entries found expired at a turn or purged after expiry;
  ``entries_dropped_total{reason}`` – entries removed for other reasons.
* ``node_up{node,role}`` – 1 when the node is up (passes its health checks; a drained node
  stays up: ``/admin/nodes`` shows the drains).
* ``node_config_conflicts`` – node ids another router on the same shared state last listed
  with another URL (replicas listing the nodes in another order: ``index.node_urls``).
* ``upstream_errors_total{node,kind}`` – failed calls to nodes (``connect``, ``timeout``,
  ``closed``, ``status``, ``capacity`` (HTTP 503), ``protocol``, ``error_event``); a node's
  4xx is the client's fault and not counted.
* ``retries_total{role}`` – P or D requests retried.
* ``reports_total{outcome}`` – D reports: ``matched``, ``unknown_turn`` (no such turn id:
  forged, or for a turn already settled long ago), ``late`` (the turn had settled from D's
  own response), ``invalid`` (not the connector's format), ``mismatch_*`` (content disagrees
  with the turn, see ``core.report``; one refused for D's engine alone is heard again once
  the engine check it raised has ended, and counted again if that gives another outcome);
  ``engine_checks_total{node,outcome}`` – checks of a D's engine (``router.engine_check``)
  that a report or a sync naming another engine raised, or a D that came up with its engine
  unknown: ``learned`` (the latter, answered), ``restarted`` (D's own answer named a new
  engine, now known), ``rank`` (another rank of a data-parallel D, now known), ``same``,
  ``no_params``, ``failed``;
  ``decode_ranks_total{reason}`` – follow-ups on a data-parallel D that holds their turn:
  sent to its rank (``affinity``) or not (``released``, ``restarted``, ``rank_full``,
  ``rank_busy``, ``not_addressable``: ``core.engine_group.decode_rank``), and ranks D
  refused (``refused``: the turn went again without one);
  ``turn_entries_total{outcome}`` – how each D turn
  settled (``committed``, ``no_kv``, ``report_timeout``, ``no_params`` (a stream without a
  report target ended without params), ``failed``, ...).
* ``room_reads_total{node,outcome}`` – reads of each D's room from its own ``/metrics``
  (``NodeRegistry.read_room``, every ``room_interval_s``): ``ok``, ``no_gauges`` (answered
  without vLLM's gauges: D selection then has only D's syncs), ``failed``.
* ``retained_tokens{node}`` – tokens each D retains for live entries (retention pressure);
  ``expired_unused_token_seconds_total`` – retention nobody read: tokens x seconds of
  entries that expired unused; ``turn_gap_seconds`` – time from a conversation's previous
  turn (its entry's creation) to the next turn (histogram).
* D's retention, from D's own syncs (``router.retention``): ``d_retained_requests{node}``,
  ``d_retained_blocks{node}``, ``d_retained_tokens{node}``, ``d_retained_bytes{node}``,
  ``d_free_blocks{node}``, ``d_total_blocks{node}`` (gauges) and
  ``d_releases_total{node,cause}`` (D's count since it started: ``pressure``, ``router``,
  ``expired``); the router's side: ``retention_syncs_total{outcome}`` (``ok``,
  ``invalid``, ``unknown_engine``, ``bad_token``: not at the URL the router gave that D,
  heard only in its releases and asks; ``unavailable``: failed with a 503, the shared state
  did not answer), ``retention_releases_seen_total{node,cause}``
  (releases the syncs told this replica of), ``entries_released_total{node}`` (entries
  they marked released when told; a release told before its turn's entry was stored marks
  the entry as it is stored, counted in the releases seen only),
  ``release_orders_total{node}`` (orders delivered to D, or sent through P to a stock D:
  ``router.stock_release``),
  ``release_requests_total{node,answer}`` (turns D asked to free: ``dropped``, or
  ``reading`` while a P leg reads them; each ask once per answer, however often D repeats
  it);
  ``retain_time_decisions_total{reason}`` (``prior``, ``learned``, ``headroom``) and
  ``retain_seconds`` (histogram): the per-turn retention times sent to D.
* ``state_errors_total{op}`` – shared-state (Redis) calls that failed or timed out
  (``get``, ``put``, ``claim``, ``drop``, ``drop_node``, ``drop_engine``, ``decode``; the
  response store's ``response_get``, ``response_put``, ``response_delete``).
* ``stored_responses_evicted_total{reason}`` – stored Responses that left the response
  store before anyone asked for them to: ``expired``, or ``capacity`` (its size bound).
* ``in_flight`` – generation requests in flight (streams until their end);
  ``rejected_requests_total{reason}`` – requests refused before routing: ``overload`` (429,
  over ``max_in_flight``) or ``draining`` (503, shutting down).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvrelay.core.retention_sync import RetentionSync

_P = "kvrelay_router_"
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
_GAP_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)

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
            _P + "node_up", "1 if the node is up (drained or not)", ["node", "role"], registry=r
        )
        self.node_config_conflicts = Gauge(
            _P + "node_config_conflicts",
            "Node ids another router on the same shared state lists with another URL",
            registry=r,
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
        self.engine_checks = Counter(
            _P + "engine_checks_total", "Checks of a D's engine id (a D up with its engine "
            "unknown, or a report or sync naming another engine), by how they ended",
            ["node", "outcome"], registry=r,
        )
        self.decode_ranks = Counter(
            _P + "decode_ranks_total", "Follow-ups on the data-parallel D that holds their "
            "turn: named its rank (affinity) or why not", ["reason"], registry=r,
        )
        self.room_reads = Counter(
            _P + "room_reads_total", "Reads of a D's room from its /metrics, by outcome",
            ["node", "outcome"], registry=r,
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
        self.responses_evicted = Counter(
            _P + "stored_responses_evicted_total", "Stored responses evicted, by reason",
            ["reason"], registry=r,
        )
        self.expired_unused = Counter(
            _P + "expired_unused_token_seconds", "Retention nobody read: tokens x seconds of "
            "entries that expired unused", registry=r,
        )
        self.turn_gap = Histogram(
            _P + "turn_gap_seconds", "Time from a conversation's previous turn to the next",
            buckets=_GAP_BUCKETS, registry=r,
        )
        self.retention_syncs = Counter(
            _P + "retention_syncs_total", "D retention syncs received, by outcome",
            ["outcome"], registry=r,
        )
        self.releases_seen = Counter(
            _P + "retention_releases_seen_total", "Releases D's syncs told of, by D and cause",
            ["node", "cause"], registry=r,
        )
        self.entries_released = Counter(
            _P + "entries_released_total", "Entries marked released by D's syncs",
            ["node"], registry=r,
        )
        self.release_requests = Counter(
            _P + "release_requests_total", "Turns D asked to free itself, by the router's "
            "answer (dropped: D may free it; reading: a P leg reads it)", ["node", "answer"],
            registry=r,
        )
        self.release_orders = Counter(
            _P + "release_orders_total",
            "Release orders delivered to D (in its sync's answer, or through P to a stock D)",
            ["node"], registry=r,
        )
        self.retain_decisions = Counter(
            _P + "retain_time_decisions_total", "Per-turn retention times sent to D, by where "
            "they came from", ["reason"], registry=r,
        )
        self.retain_seconds = Histogram(
            _P + "retain_seconds", "Per-turn retention times sent to D (kvrelay_retain_s)",
            buckets=_GAP_BUCKETS, registry=r,
        )
        self.text_lookups = Counter(
            _P + "text_lookups_total", "Completions lookups in the conversation index",
            registry=r,
        )
        self.text_lookup_digests = Counter(
            _P + "text_lookup_digests_total", "Digests completions lookups computed (at most "
            "MAX_TEXT_DIGESTS each, however many entries a scope holds)", registry=r,
        )
        self._retained: _Retained | None = None
        self._d_retention: _DRetention | None = None
        self._children: dict[tuple[object, ...], Any] = {}

    def text_lookup(self, num_digests: int) -> None:
        """One completions lookup that computed ``num_digests`` digests."""
        self.text_lookups.inc()
        self.text_lookup_digests.inc(num_digests)

    def track_retained_tokens(self, read: Callable[[], Mapping[str, int]]) -> None:
        """Make ``retained_tokens{node}`` read ``read()`` at scrape time."""
        if self._retained is None:
            self._retained = _Retained(read)
            self.registry.register(self._retained)

    def track_d_retention(self, read: Callable[[], Sequence[tuple[str, RetentionSync]]]) -> None:
        """Make the ``d_*`` retention gauges read each D's latest sync at scrape time."""
        if self._d_retention is None:
            self._d_retention = _DRetention(read)
            self.registry.register(self._d_retention)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: prometheus_client's lookup takes a lock and
        builds a key on every call, and these run several times per turn."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def upstream_error(self, node: str, kind: str, status: int | None) -> None:
        self.child(self.upstream_errors, node, "capacity" if status == 503 else kind).inc()

    def decided(self, action: str, reason: str) -> None:
        self.child(self.decisions, action, reason).inc()

    def tokens(self, reused: int, recomputed: int) -> None:
        self.child(self.prompt_tokens, "reused").inc(max(0, reused))
        self.child(self.prompt_tokens, "recomputed").inc(max(0, recomputed))

    def request_done(self, endpoint: str, status: int) -> None:
        self.child(self.requests, endpoint, str(status)).inc()

    def track_live_entries(self, count: Callable[[], int]) -> None:
        """Make ``live_entries`` read ``count()`` at scrape time."""
        self.live_entries.set_function(lambda: float(count()))

    def track_pending_reports(self, count: Callable[[], int]) -> None:
        self.pending_reports.set_function(lambda: float(count()))

    def render(self, *, sizes: bool = True) -> bytes:
        """The exposition text; without ``sizes``, none of ``SIZE_SERIES`` (what an
        unauthenticated scrape gets, docs/security.md)."""
        if sizes:
            return generate_latest(self.registry)
        return generate_latest(_Without(self.registry, SIZE_SERIES))


SIZE_SERIES = frozenset({
    _P + "prompt_tokens", _P + "retained_tokens", _P + "expired_unused_token_seconds",
    _P + "d_retained_tokens", _P + "d_retained_blocks", _P + "d_retained_bytes",
    _P + "d_free_blocks", _P + "text_lookup_digests",
})
"""Families (names without ``_total``) that add up or follow the sizes of requests (D's
retained and free KV move with each turn's length; a completions lookup's digests grow with
its prompt's): at low traffic they tell whoever reads them how long another caller's prompts
are, so only an authenticated scrape (``metrics_key``, the admin key, or the internal
listener) gets them."""


class _Without(Collector):
    """A registry's families but those named in ``names``."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry = registry
        self._names = names

    def collect(self) -> Iterator[Metric]:
        return (f for f in self._registry.collect() if f.name not in self._names)


class _Retained(Collector):
    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            _P + "retained_tokens", "Tokens each D retains for live entries", labels=["node"]
        )
        for node, tokens in sorted(self._read().items()):
            family.add_metric([node], float(tokens))
        yield family


class _DRetention(Collector):
    """D's own retention numbers, from its latest sync with this router."""

    def __init__(self, read: Callable[[], Sequence[tuple[str, RetentionSync]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        gauges: dict[str, tuple[str, Callable[[RetentionSync], int]]] = {
            "d_retained_requests": ("Finished requests D retains for a P to read",
                                    lambda s: s.retained_requests),
            "d_retained_blocks": ("KV blocks D retains", lambda s: s.retained_blocks),
            "d_retained_tokens": ("Tokens D retains", lambda s: s.retained_tokens),
            "d_retained_bytes": ("KV bytes D retains", lambda s: s.retained_bytes),
            "d_free_blocks": ("Free KV blocks on D", lambda s: s.num_blocks_free),
            "d_total_blocks": ("KV blocks on D", lambda s: s.num_blocks_total),
        }
        syncs = list(self._read())
        for name, (help_text, value) in gauges.items():
            family = GaugeMetricFamily(_P + name, help_text + " (D's own count)",
                                       labels=["node"])
            for node, sync in syncs:
                family.add_metric([node], float(value(sync)))
            yield family
        releases = CounterMetricFamily(
            _P + "d_releases", "Retained turns D released before a P read them, by cause "
            "(D's count since it started)", labels=["node", "cause"],
        )
        for node, sync in syncs:
            for cause, count in sorted(sync.releases_total.items()):
                releases.add_metric([node, cause], float(count))
        yield releases
