"""The monitoring dashboard as one typed table: every panel and its PromQL queries.

Everything that shows kvrelay's metrics reads this table: the Grafana dashboard
(``kvrelay.deploy.grafana``), its PNG rendering from Prometheus data
(``kvrelay.deploy.dashboard_png``) and the test that runs a real Prometheus against a router
and engines and checks that every query returns data
(``tests/component/test_monitoring_prometheus.py``). Each metric name appears once, in the
constants below, so a renamed metric is a one-line change here.

``$__rate_interval`` is Grafana's rate window; ``rate_window`` replaces it for plain
Prometheus queries. Series from P and D carry a ``component`` label (``prefill``,
``decode``) that the scrape config sets (``kvrelay.deploy.prometheus``; the Kubernetes
ServiceMonitor relabels it from the Services' ``app.kubernetes.io/component``).
"""

from __future__ import annotations

from dataclasses import dataclass

# -- metric names (router: docs/router.md "Metrics"; engines: vLLM's own) ------------------
TURN_DECISIONS = "kvrelay_router_turn_decisions_total"
PROMPT_TOKENS = "kvrelay_router_prompt_tokens_total"
TTFT = "kvrelay_router_ttft_seconds"
RETAINED_TOKENS = "kvrelay_router_retained_tokens"
LIVE_ENTRIES = "kvrelay_router_live_entries"
PENDING_REPORTS = "kvrelay_router_pending_reports"
NODE_UP = "kvrelay_router_node_up"
UPSTREAM_ERRORS = "kvrelay_router_upstream_errors_total"
STATE_ERRORS = "kvrelay_router_state_errors_total"
REQUESTS = "kvrelay_router_requests_total"
D_RETAINED_BYTES = "kvrelay_router_d_retained_bytes"
D_RETAINED_BLOCKS = "kvrelay_router_d_retained_blocks"
D_FREE_BLOCKS = "kvrelay_router_d_free_blocks"
D_TOTAL_BLOCKS = "kvrelay_router_d_total_blocks"
D_RELEASES = "kvrelay_router_d_releases_total"
RETAIN_SECONDS = "kvrelay_router_retain_seconds"
VLLM_PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"

RATE = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel; ``legend`` is Grafana's ``legendFormat``."""

    expr: str
    legend: str

    def for_prometheus(self, rate_window: str) -> str:
        """The expression with Grafana's rate window replaced (e.g. ``"1m"``)."""
        return self.expr.replace(RATE, rate_window)


@dataclass(frozen=True)
class Panel:
    """A time-series panel; ``unit`` is a Grafana unit id (``reqps``, ``s``, ...)."""

    title: str
    unit: str
    description: str
    queries: tuple[Query, ...]


def _rate(metric: str, by: str, selector: str = "") -> str:
    return f"sum by ({by}) (rate({metric}{selector}[{RATE}]))"


def _ttft(quantile: float) -> Query:
    return Query(
        f"histogram_quantile({quantile}, sum by (le, action) (rate({TTFT}_bucket[{RATE}])))",
        f"p{round(quantile * 100)} {{{{action}}}}")


PANELS: tuple[Panel, ...] = (
    Panel("Turns by action", "reqps",
          "Routed turns per second: pull (P pulls D's KV), recompute, direct.",
          (Query(_rate(TURN_DECISIONS, "action"), "{{action}}"),)),
    Panel("Turns by reason", "reqps",
          "Why each turn pulled or recomputed (docs/router.md, 'Decisions and reasons').",
          (Query(_rate(TURN_DECISIONS, "action, reason"), "{{action}} {{reason}}"),)),
    Panel("Reuse rate", "percentunit",
          "Prompt tokens P took from D's KV over all prompt tokens of routed turns.",
          (Query(f'sum(rate({PROMPT_TOKENS}{{source="reused"}}[{RATE}])) '
                 f"/ sum(rate({PROMPT_TOKENS}[{RATE}]))", "reused / prompt"),)),
    Panel("TTFT by action", "s",
          "Time to the first chunk sent to the client, streamed turns.",
          (_ttft(0.5), _ttft(0.95))),
    Panel("Retained KV per D", "short",
          "Tokens each D retains for the router's live conversation entries.",
          (Query(f"max by (node) ({RETAINED_TOKENS})", "{{node}}"),)),
    Panel("Retained KV on D (D's count)", "bytes",
          "KV bytes each D's kvrelay connector holds for finished turns, from D's own "
          "retention syncs (not the router's estimate).",
          (Query(f"max by (node) ({D_RETAINED_BYTES})", "{{node}}"),)),
    Panel("D's KV blocks: retained and free", "short",
          "Blocks each D retains for pulls, has free, and has in all (D's retention syncs): "
          "retention yields to live work as free blocks run out.",
          (Query(f"max by (node) ({D_RETAINED_BLOCKS})", "retained {{node}}"),
           Query(f"max by (node) ({D_FREE_BLOCKS})", "free {{node}}"),
           Query(f"max by (node) ({D_TOTAL_BLOCKS})", "total {{node}}"))),
    Panel("Retention releases by cause", "reqps",
          "Retained turns D released before a P read them: pressure (live work needed the "
          "blocks), headroom (over the operator's share), router (the router's order: a "
          "dropped entry), expired (the turn's retention time ran out).",
          (Query(f"max by (node, cause) (rate({D_RELEASES}[{RATE}]))",
                 "{{node}} {{cause}}"),)),
    Panel("Per-turn retention time", "s",
          "How long D is asked to keep each turn (kvrelay_retain_s), learned from the gaps "
          "between turns.",
          (Query(f"histogram_quantile(0.5, sum by (le) (rate({RETAIN_SECONDS}_bucket[{RATE}])))",
                 "p50"),
           Query(f"histogram_quantile(0.95, sum by (le) (rate({RETAIN_SECONDS}_bucket[{RATE}])))",
                 "p95"))),
    Panel("Conversation entries", "short",
          "Live entries (D's KV the router can pull) and turns waiting for D's report.",
          (Query(f"sum({LIVE_ENTRIES})", "live entries"),
           Query(f"sum({PENDING_REPORTS})", "pending reports"))),
    Panel("Node health", "short",
          "1: routable, 0: down (the least healthy view over router replicas).",
          (Query(f"min by (node, role) ({NODE_UP})", "{{role}} {{node}}"),)),
    Panel("Requests by status", "reqps",
          "Client requests to the OpenAI endpoints by HTTP status.",
          (Query(_rate(REQUESTS, "status", '{endpoint=~"/v1/.*"}'), "{{status}}"),)),
    Panel("Upstream errors", "reqps",
          "Failed calls to P and D by node and kind (connect, timeout, closed, status, ...).",
          (Query(_rate(UPSTREAM_ERRORS, "node, kind"), "{{node}} {{kind}}"),)),
    Panel("Redis errors", "reqps",
          "Shared-state calls that failed or timed out, by operation (turns recompute).",
          (Query(_rate(STATE_ERRORS, "op"), "{{op}}"),)),
    Panel("P and D prompt tokens by source", "short",
          "vLLM's prompt tokens per second on P and D: computed locally, prefix-cache hits, "
          "pulled over NIXL (external_kv_transfer).",
          (Query(_rate(VLLM_PROMPT_TOKENS_BY_SOURCE, "component, source"),
                 "{{component}} {{source}}"),)),
    Panel("KV cache usage", "percentunit",
          "vLLM's KV-cache usage per node; on D it includes KV retained for pulls.",
          (Query(f"max by (component, instance) ({VLLM_KV_CACHE_USAGE})",
                 "{{component}} {{instance}}"),)),
)


def all_queries() -> list[tuple[Panel, Query]]:
    return [(panel, query) for panel in PANELS for query in panel.queries]
