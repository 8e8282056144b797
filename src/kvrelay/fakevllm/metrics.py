"""Prometheus counters of one fake engine, named and labelled like vLLM 0.32's.

Plain integers on the hot path; ``render_metrics`` writes the text exposition format the way
``prometheus_client`` does for vLLM (``_total`` counters, sorted labels, float values,
histograms with their ``+Inf`` bucket, ``_count`` and ``_sum``). Counters restart from zero
when the engine restarts, as a real process's would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROMPT_SOURCES: tuple[str, ...] = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class EngineMetrics:
    """Counters since the engine (re)started."""

    prompt_tokens: int = 0
    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    generation_tokens: int = 0
    nixl_failed_transfers: int = 0
    nixl_kv_expired_reqs: int = 0
    nixl_notifications_after_expiry: int = 0
    nixl_xfer_count: int = 0
    nixl_xfer_time_s: float = 0.0
    nixl_bytes_count: int = 0
    nixl_bytes: int = 0
    request_success: dict[str, int] = field(default_factory=dict)

    def record_prompt(
        self, prompt: int, local_hit: int, external: int, prefix_caching: bool
    ) -> None:
        """One scheduled prefill: ``prompt`` tokens, of which ``local_hit`` came from the
        local prefix cache and ``external`` from a KV transfer."""
        self.prompt_tokens += prompt
        self.local_cache_hit += local_hit
        self.external_kv_transfer += external
        self.local_compute += prompt - local_hit - external
        if prefix_caching:
            self.prefix_cache_queries += prompt
            self.prefix_cache_hits += local_hit
        self.external_prefix_cache_queries += prompt - local_hit
        self.external_prefix_cache_hits += external

    def record_transfer(self, seconds: float, num_bytes: int) -> None:
        self.nixl_xfer_count += 1
        self.nixl_xfer_time_s += seconds
        self.nixl_bytes_count += 1
        self.nixl_bytes += num_bytes

    def record_finished(self, finish_reason: str) -> None:
        self.request_success[finish_reason] = self.request_success.get(finish_reason, 0) + 1


def render_metrics(
    m: EngineMetrics,
    *,
    model_name: str,
    running: int,
    waiting: int,
    kv_cache_usage: float,
    num_preemptions: int = 0,
    num_gpu_blocks: int | None = None,
    block_size: int | None = None,
) -> str:
    """The ``/metrics`` body; with ``num_gpu_blocks`` and ``block_size``, vLLM's
    ``cache_config_info`` too (its labels: the cache config's fields, of which the fake
    has these, and ``engine``)."""
    base = _labels(model_name)
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            lines.append(f"{name}{suffix}{{{labels}}} {float(value)!r}")

    def counter(name: str, doc: str, value: float) -> None:
        family(name, "counter", doc, [("", base, value)])

    def gauge(name: str, doc: str, value: float) -> None:
        family(name, "gauge", doc, [("", base, value)])

    def histogram(name: str, doc: str, count: int, total: float) -> None:
        inf = _labels(model_name, le="+Inf")
        family(
            name,
            "histogram",
            doc,
            [("_bucket", inf, count), ("_count", base, count), ("_sum", base, total)],
        )

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    # vLLM splits the waiting by reason; the fake's wait only for capacity (blocks, a slot):
    # it does not queue a request that pulls its KV as vLLM does (``deferred``)
    family("vllm:num_requests_waiting_by_reason", "gauge",
           "Number of waiting requests by reason.",
           [("", _labels(model_name, reason="capacity"), waiting),
            ("", _labels(model_name, reason="deferred"), 0)])
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage)
    if num_gpu_blocks is not None and block_size is not None:
        info = {"block_size": str(block_size), "engine": "0",
                "kv_cache_size_tokens": str(num_gpu_blocks * block_size),
                "num_gpu_blocks": str(num_gpu_blocks)}
        family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
               [("", ",".join(f'{k}="{v}"' for k, v in sorted(info.items())), 1.0)])
    counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
            num_preemptions)
    counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in tokens.",
            m.prefix_cache_queries)
    counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in tokens.", m.prefix_cache_hits)
    counter("vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector, in tokens.",
            m.external_prefix_cache_queries)
    counter("vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector, in tokens.",
            m.external_prefix_cache_hits)
    counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", m.prompt_tokens)
    by_source = {
        "local_compute": m.local_compute,
        "local_cache_hit": m.local_cache_hit,
        "external_kv_transfer": m.external_kv_transfer,
    }
    family(
        "vllm:prompt_tokens_by_source_total",
        "counter",
        "Number of prompt tokens by source.",
        [("", _labels(model_name, source=s), by_source[s]) for s in PROMPT_SOURCES],
    )
    counter("vllm:generation_tokens_total", "Number of generation tokens processed.",
            m.generation_tokens)
    family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            ("", _labels(model_name, finished_reason=reason), count)
            for reason, count in sorted(m.request_success.items())
        ],
    )
    counter("vllm:nixl_num_failed_transfers_total", "Number of failed NIXL KV Cache transfers.",
            m.nixl_failed_transfers)
    counter("vllm:nixl_num_kv_expired_reqs_total",
            "Number of requests that had their KV expire.", m.nixl_kv_expired_reqs)
    counter("vllm:nixl_num_notifications_after_expiry_total",
            "Number of completion notifications for requests that were no longer tracked.",
            m.nixl_notifications_after_expiry)
    histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for KV cache.",
              m.nixl_xfer_count, m.nixl_xfer_time_s)
    histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL transfer.",
              m.nixl_bytes_count, float(m.nixl_bytes))
    return "\n".join(lines) + "\n"


def _labels(model_name: str, **extra: str) -> str:
    """Label set in prometheus_client's order (sorted by name)."""
    items = {"engine": "0", "model_name": model_name, **extra}
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(items.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
